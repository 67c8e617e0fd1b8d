"""`recompute`: the trainer's forward with its current weights, before the round's first update. Exact on
on-policy schedules; under async (or partial rollouts) tokens of older versions get the wrong anchor -- the
missing-old-logit error the audit metric shows."""

from __future__ import annotations

from mcore_rl.oldlogp.base import OldLogpSource, recompute_logp
from mcore_rl.oldlogp.registry import register_source


@register_source("recompute")
class RecomputeSource(OldLogpSource):
    from_live_weights = True

    def compute(self, rb, version: int):
        return recompute_logp(self.ctx, rb)
