"""Old-log-prob sources (`algorithm.old_logp_source`): rollout, recompute, snapshot, old_logit_model, interrupt.
See docs/old_logits.md for the math and how to pick one."""

from mcore_rl.oldlogp.base import OldLogpSource, SourceContext
from mcore_rl.oldlogp.registry import SOURCES, build_source

__all__ = ["OldLogpSource", "SourceContext", "SOURCES", "build_source"]
