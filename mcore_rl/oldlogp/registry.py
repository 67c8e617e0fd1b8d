"""Name -> old-log-prob source class (`algorithm.old_logp_source`).

The algorithm config validates its `old_logp_source` against these names (and asks `is_exact` whether a source
scores every token under its own version), so the list of sources lives here only.
"""

from __future__ import annotations

from collections.abc import Callable

from mcore_rl.oldlogp.base import OldLogpSource, SourceContext
from mcore_rl.registry import Registry

SOURCES: Registry[type[OldLogpSource]] = Registry(
    "algorithm.old_logp_source", {name: f"mcore_rl.oldlogp.{name}" for name in
                                  ("rollout", "recompute", "snapshot", "old_logit_model", "interrupt")},
)  # fmt: skip


def register_source(name: str) -> Callable[[type[OldLogpSource]], type[OldLogpSource]]:
    def deco(cls: type[OldLogpSource]) -> type[OldLogpSource]:
        cls.name = name
        return SOURCES.register(name)(cls)

    return deco


def is_exact(name: str) -> bool:
    """Whether source `name` scores each token under the weights of the version that generated it."""
    return SOURCES.get(name).exact


def build_source(name: str, ctx: SourceContext) -> OldLogpSource:
    return SOURCES.get(name)(ctx)
