"""`rollout`: the anchor is the engine's own log-prob of each token (no trainer forward). Exact in version (the
engine tags each token with the weights that sampled it) but carries the train/inference mismatch."""

from __future__ import annotations

from mcore_rl.oldlogp.base import OldLogpSource
from mcore_rl.oldlogp.registry import register_source


@register_source("rollout")
class RolloutSource(OldLogpSource):
    def compute(self, rb, version: int):
        return None  # the algorithm anchors on rb.rollout_logp (Algorithm.anchor_logp)
