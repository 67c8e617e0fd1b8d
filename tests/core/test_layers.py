"""Strict layers (docs/architecture.md): every `mcore_rl` import, module-level or inside a function, points down.

Each unit (a top-level package or module under mcore_rl/) sits in one layer; a module may import its own unit and
units of lower layers only, never a sibling of its own layer nor anything above. The imports are read from the
source (AST), so a function-local import that would only run on some code path counts as much as a top-level one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "mcore_rl"

# bottom to top; keep in step with the diagram in docs/architecture.md
LAYERS: list[tuple[str, ...]] = [
    # no mcore_rl imports at all
    ("faults", "plugins"),
    ("utils", "fsio", "registry", "api_key", "compat", "dtypes"),
    ("distributed",),
    ("agreement", "config"),
    ("models", "rewards", "metrics_log"),
    ("data", "policy"),
    ("batch", "checkpoint_io", "rollout"),
    ("oldlogp", "convert", "envs"),
    # an algorithm config names its old-logit source (oldlogp/registry.py)
    ("algorithms",),
    ("evaluation",),
    ("trainer", "config_reads"),
    # the CLI
    ("train",),
    # supervised fine-tuning (mcore-rl-sft): reuses the trainer's checkpoints, logs, setup and HF export, and the
    # CLI's one-line composition errors
    ("sft",),
]

# Upward imports still to be removed, each with the room that owns it. An entry that no longer occurs fails the
# test too, so this list can only shrink.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {
    ("mcore_rl.config", "mcore_rl.algorithms"): "spine: config/ registers and validates algorithm schemas",
}

ALLOWED_CYCLES: dict[frozenset[str], str] = {
    frozenset({"mcore_rl.rollout.sglang.client", "mcore_rl.rollout.sglang.weight_session"}): (
        "dedup: weight_session.py imports SGLangHTTPError from client.py, which imports weight_session.py"
    ),
}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path = ROOT) -> list[tuple[str, int]]:
    """(imported mcore_rl module, line) for every import statement in the file, at any depth."""
    mod = module_name(path, root)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from pkg import x`: x may be a module (resolve_module keeps the longest prefix that is a file)
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return [(m, line) for m, line in out if m == root.name or m.startswith(root.name + ".")]


def resolve_module(name: str, modules: set[str]) -> str | None:
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or None


def import_cycles(root: Path = ROOT) -> list[list[str]]:
    """Groups of modules that import each other, directly or round a loop (strongly connected components)."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    graph = {
        m: {resolve_module(d, set(files)) for d, _ in imports_of(p, root)} - {m, None}
        for m, p in files.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def unit_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the package root (`mcore_rl/__init__.py`)


def layer_index(layers: list[tuple[str, ...]]) -> dict[str, int]:
    return {unit: i for i, tier in enumerate(layers) for unit in tier}


def upward_imports(root: Path = ROOT, layers: list[tuple[str, ...]] = LAYERS) -> list[tuple[str, str, str]]:
    """(importing module, imported module, 'file:line why') for every import that does not point down."""
    rank = layer_index(layers)
    modules = {module_name(p, root) for p in root.rglob("*.py")}
    found = []
    for path in sorted(root.rglob("*.py")):
        src = module_name(path, root)
        a = unit_of(src)
        for name, line in imports_of(path, root):
            dst = resolve_module(name, modules) or name
            b = unit_of(dst)
            if a is None or b is None or a == b:
                continue
            if rank[b] >= rank[a]:
                where = f"{path.relative_to(root.parent)}:{line}"
                found.append((src, dst, f"{where}: {a} (layer {rank[a]}) imports {b} (layer {rank[b]})"))
    return found


def test_every_unit_has_a_layer():
    units = {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    units |= {p.parent.name for p in ROOT.glob("*/__init__.py")}
    missing = sorted(units - set(layer_index(LAYERS)))
    assert not missing, f"units without a layer (add them to LAYERS and docs/architecture.md): {missing}"
    stale = sorted(set(layer_index(LAYERS)) - units)
    assert not stale, f"LAYERS names units that do not exist: {stale}"
    assert sum(map(len, LAYERS)) == len(layer_index(LAYERS)), "a unit is listed in two layers"


def test_imports_point_down():
    found = upward_imports()
    bad = [why for src, dst, why in found if (src, dst) not in ALLOWED_UPWARD]
    assert not bad, "upward imports:\n" + "\n".join(bad)
    gone = sorted(set(ALLOWED_UPWARD) - {(src, dst) for src, dst, _ in found})
    assert not gone, f"allow-listed upward imports no longer occur; remove them from ALLOWED_UPWARD: {gone}"


def test_no_import_cycles():
    found = import_cycles()
    cycles = [c for c in found if frozenset(c) not in ALLOWED_CYCLES]
    assert not cycles, f"modules that import each other: {cycles}"
    gone = [set(c) for c in ALLOWED_CYCLES if sorted(c) not in found]
    assert not gone, f"allow-listed cycles no longer occur; remove them from ALLOWED_CYCLES: {gone}"


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "mcore_rl"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.mark.parametrize("planted, line, target", [
    ("from mcore_rl.trainer.loop import run\n", 2, "trainer (layer 2)"),                      # module level
    ("def f():\n    from mcore_rl.trainer import loop\n    return loop\n", 3, "trainer (layer 2)"),  # in a function
    ("from ..trainer import loop\n", 2, "trainer (layer 2)"),                                 # relative
    ("from mcore_rl import trainer\n", 2, "trainer (layer 2)"),                               # the root's names
    ("import mcore_rl.policy.step\n", 2, "policy (layer 1)"),                                 # a sibling
])  # fmt: skip
def test_planted_violation_is_found(tmp_path, planted, line, target):
    layers = [("utils",), ("data", "policy"), ("trainer",)]
    root = _tree(tmp_path, {
        "__init__.py": "", "utils.py": "", "policy/__init__.py": "", "policy/step.py": "",
        "trainer/__init__.py": "", "trainer/loop.py": "from mcore_rl.data import records\nimport mcore_rl.utils\n",
        "data/__init__.py": "", "data/records.py": "from mcore_rl.utils import x\n" + planted,
    })  # fmt: skip
    found = upward_imports(root, layers)
    assert len(found) == 1 and found[0][0] == "mcore_rl.data.records", found
    assert found[0][2] == f"mcore_rl/data/records.py:{line}: data (layer 1) imports {target}"
