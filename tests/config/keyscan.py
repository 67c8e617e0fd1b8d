"""Helpers for the config audits: compose every group option, list leaf keys, scan code and tests for use."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "hydra_conf"
# groups of the main config (hydra/ is Hydra's own: its launcher yaml is checked by tests/slurm)
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra")
# options that need a value no yaml can carry
REQUIRED = {"model=hf": ["model.hf_path=/nonexistent/hf-folder"]}


def group_options() -> list[tuple[str, str]]:
    return [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]


def compose(overrides: list[str], config_name: str = "config") -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import mcore_rl.config  # noqa: F401  (registers the schemas)

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        # run.dir defaults to Hydra's output dir, which only exists inside a Hydra run
        return hydra_compose(config_name=config_name, overrides=["run.dir=/nonexistent/run", *overrides])


def option_overrides(group: str, option: str) -> list[str]:
    sel = f"{group}={option}"
    return [sel, *REQUIRED.get(sel, [])]


def leaf_keys(node: Any, prefix: str = "") -> Iterator[str]:
    """Dotted paths of every leaf (a dict value that is not itself a dict; lists are leaves)."""
    if isinstance(node, DictConfig):
        for k in node.keys():
            v = node._get_node(k)
            path = f"{prefix}{k}"
            if isinstance(v, DictConfig) and not v._is_none() and len(v) and not _free_form(path):
                yield from leaf_keys(v, path + ".")
            else:
                yield path
    elif isinstance(node, ListConfig):
        yield prefix.rstrip(".")


# dict-valued keys whose CONTENT is free-form data for another library, not our keys
FREE_FORM = ("model.tiny", "data.options", "eval.data", "reward.weights", "rollout.nccl")


def _free_form(path: str) -> bool:
    return path in FREE_FORM


OVERRIDE = re.compile(r"^[+~]{0,2}([a-z_]\w*(?:\.\w+)*)=")


def cli_overrides_in_tests(root: Path) -> set[str]:
    """Dotted keys that some test passes as a CLI override (`key=value` string constants, f-strings included)."""
    keys: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            s = None
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                s = node.value
            elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
                s = str(node.values[0].value)
            if s and (m := OVERRIDE.match(s)):
                keys.add(m.group(1))
    return keys - set(GROUPS)  # `model=tiny` selects a group entry; it sets none of its keys
