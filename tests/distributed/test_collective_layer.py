"""Every collective in mcore_rl goes through mcore_rl/distributed.py (AST scan of the package).

Why: gloo (the CPU test backend) accepts CPU tensors that NCCL refuses, so a direct `torch.distributed` call with
a host tensor passes every CPU test and stops every GPU run. `distributed.py` picks the device from the group's
backend; a call anywhere else bypasses that. Megatron's own collectives live in site-packages and are not scanned.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "mcore_rl"
LAYER = "mcore_rl/distributed.py"

# Files allowed to call torch.distributed directly while they are being migrated (none now). The set can only
# shrink: a file listed here without any direct collective fails the test.
PENDING: set[str] = set()

COLLECTIVES = {
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "all_gather_coalesced", "broadcast", "broadcast_object_list", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "send", "recv", "isend", "irecv", "batch_isend_irecv", "P2POp", "send_object_list",
    "recv_object_list", "barrier", "monitored_barrier", "gather", "gather_object", "scatter",
    "scatter_object_list", "all_to_all", "all_to_all_single",
}
TD_MODULES = ("torch.distributed", "torch.distributed.distributed_c10d")
# the layer's tensor helpers: the tensor handed to them must not be built on a hard-coded device
LAYER_TENSOR_HELPERS = {"all_reduce", "all_gather", "broadcast", "broadcast_from_group_rank", "sum_reducer"}


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def direct_collectives(source: str) -> list[tuple[int, str]]:
    """(line, call) of every torch.distributed collective called in `source`, whatever the import spelling:
    `torch.distributed.x`, `import torch.distributed as dist` / `from torch import distributed` then `dist.x`,
    `from torch.distributed import x [as y]`, and the distributed_c10d module likewise."""
    tree = ast.parse(source)
    modules = {"torch.distributed": "torch.distributed", "torch.distributed.distributed_c10d": TD_MODULES[1]}
    names: dict[str, str] = {}  # local name -> collective
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in TD_MODULES and a.asname:
                    modules[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in TD_MODULES:
                    modules[a.asname or a.name] = full
                elif node.module in TD_MODULES and a.name in COLLECTIVES:
                    names[a.asname or a.name] = a.name
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Name) and node.func.id in names:
            found.append((node.lineno, names[node.func.id]))
        elif isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
            owner = _dotted(node.func.value)
            if owner in modules:
                found.append((node.lineno, f"{owner}.{node.func.attr}"))
    return sorted(found)


def _hard_coded_device(expr: ast.AST) -> str | None:
    """The first hard-coded device in `expr`: device="cuda"/torch.device("cuda", ...), .cuda(), .to("cuda:0")."""
    for node in ast.walk(expr):
        if not isinstance(node, ast.Call):
            continue
        for kw in node.keywords:
            if kw.arg == "device" and _literal_device(kw.value):
                return ast.unparse(node)
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "cuda":
            return ast.unparse(node)
        if isinstance(f, ast.Attribute) and f.attr == "to" and node.args and _literal_device(node.args[0]):
            return ast.unparse(node)
        if _dotted(f) == "torch.device" and node.args and isinstance(node.args[0], ast.Constant):
            return ast.unparse(node)
    return None


def _literal_device(v: ast.AST) -> bool:
    if isinstance(v, ast.Constant) and isinstance(v.value, str):
        return v.value.split(":")[0] in ("cuda", "cpu", "meta")
    return isinstance(v, ast.Call) and _dotted(v.func) == "torch.device" and bool(v.args) and isinstance(
        v.args[0], ast.Constant)


def hard_coded_collective_tensors(source: str) -> list[tuple[int, str]]:
    """Calls of the layer's tensor helpers whose tensor is built on a hard-coded device, in the call itself or in
    an assignment to the name passed (same function). The layer picks the device; a call site that pins one
    either breaks on NCCL (cpu) or on gloo (cuda)."""
    tree = ast.parse(source)
    helpers = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
               and n.module == "mcore_rl.distributed" for a in n.names if a.name in LAYER_TENSOR_HELPERS}
    bad = []
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module))]
    for scope in scopes:
        assigned: dict[str, list[ast.AST]] = {}
        for n in ast.walk(scope):
            if isinstance(n, ast.Assign):
                for t in n.targets:
                    if isinstance(t, ast.Name):
                        assigned.setdefault(t.id, []).append(n.value)
        for n in ast.walk(scope):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in helpers and n.args:
                arg = n.args[0]
                exprs = [arg, *(assigned.get(arg.id, []) if isinstance(arg, ast.Name) else [])]
                for e in exprs:
                    if hit := _hard_coded_device(e):
                        bad.append((n.lineno, hit))
    return sorted(set(bad))


def _package_files() -> dict[str, str]:
    return {p.relative_to(REPO).as_posix(): p.read_text() for p in sorted(PKG.rglob("*.py"))}


# ---- the scanners catch what they must (so a clean package means something) --------------------------------------
@pytest.mark.parametrize("src", [
    "import torch.distributed as dist\ndist.all_reduce(t)",
    "import torch\ntorch.distributed.broadcast(t, 0)",
    "from torch import distributed\ndistributed.barrier()",
    "from torch.distributed import all_gather as ag\nag(parts, t)",
    "def f():\n    import torch.distributed as d\n    d.send_object_list(o, dst=1)",
    "from torch.distributed import distributed_c10d as c10d\nc10d.reduce_scatter(o, l)",
    "import torch.distributed\ntorch.distributed.all_to_all_single(o, i)",
])
def test_scanner_finds_direct_collectives(src):
    assert len(direct_collectives(src)) == 1


def test_scanner_ignores_non_collectives():
    src = ("import torch.distributed as dist\nfrom mcore_rl.distributed import all_reduce\n"
           "dist.get_rank(); dist.get_world_size(g); dist.is_initialized(); dist.new_group(backend='gloo')\n"
           "all_reduce(t, 'max', g); conn.send(x); np.broadcast_to(a, s)")
    assert direct_collectives(src) == []


@pytest.mark.parametrize("src", [
    "from mcore_rl.distributed import all_reduce\nall_reduce(torch.tensor([1.0], device='cuda'))",
    "from mcore_rl.distributed import all_reduce\ndef f():\n    n = torch.zeros(1).cuda()\n    return all_reduce(n)",
    "from mcore_rl.distributed import broadcast\nbroadcast(x.to('cuda:0'), 0)",
    "from mcore_rl.distributed import all_gather\nall_gather(torch.ones(2, device=torch.device('cpu')))",
])
def test_scanner_finds_hard_coded_devices(src):
    assert len(hard_coded_collective_tensors(src)) == 1


def test_scanner_allows_device_of_an_input():
    src = ("from mcore_rl.distributed import all_reduce\n"
           "def f(x):\n    m = torch.full(x.shape, 0.0, device=x.device)\n    return all_reduce(m) + all_reduce(x)")
    assert hard_coded_collective_tensors(src) == []


# ---- the package ------------------------------------------------------------------------------------------------
def test_no_collective_outside_the_layer():
    files = _package_files()
    assert LAYER in files and direct_collectives(files[LAYER])  # the scan sees the layer's own calls
    offenders = {path: calls for path, src in files.items() if path != LAYER and path not in PENDING
                 and (calls := direct_collectives(src))}
    assert not offenders, f"torch.distributed collectives outside {LAYER} (use its helpers): {offenders}"


def test_pending_files_still_pending():
    files = _package_files()
    done = sorted(p for p in PENDING if p not in files or not direct_collectives(files[p]))
    assert not done, f"no direct collective left in {done}: remove them from PENDING"


def test_no_hard_coded_device_for_a_collective():
    bad = {p: hits for p, src in _package_files().items() if (hits := hard_coded_collective_tensors(src))}
    assert not bad, f"tensors for collectives built on a hard-coded device (let the layer move them): {bad}"
