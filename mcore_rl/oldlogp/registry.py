"""Name -> old-log-prob source class (`algorithm.old_logp_source`)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

SOURCES: dict[str, type] = {}
_MODULES = ("rollout", "recompute", "snapshot", "old_logit_model", "interrupt")


def register_source(name: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        cls.name = name
        SOURCES[name] = cls
        return cls

    return deco


def build_source(name: str, ctx):
    for mod in _MODULES:
        importlib.import_module(f"mcore_rl.oldlogp.{mod}")
    if name not in SOURCES:
        raise ValueError(f"algorithm.old_logp_source={name!r} is not one of {sorted(SOURCES)}")
    return SOURCES[name](ctx)
