"""`interrupt`: every weight update restarts the samples in flight from their prompt under the new weights (the
engine's interrupt mode), so each sample's tokens all come from one version and the engine's log-probs are
coherent per sample. The old log-probs are that version's: scored from the version store, one forward per
distinct version in the round (a sample never needs two)."""

from __future__ import annotations

from mcore_rl.oldlogp.base import OldLogpSource
from mcore_rl.oldlogp.registry import register_source
from mcore_rl.oldlogp.store import score_by_version


def check_single_version(rb) -> None:
    v = rb.versions.masked_fill(rb.loss_mask <= 0, -1)
    hi = v.max(dim=1).values
    lo = v.masked_fill(rb.loss_mask <= 0, 1 << 62).min(dim=1).values
    bad = ((hi != lo) & (rb.loss_mask.sum(dim=1) > 0)).nonzero().flatten().tolist()
    if bad:
        raise RuntimeError(f"old_logp_source interrupt: rows {bad[:5]} span several weight versions; the engine "
                           "did not restart them at a weight update")


@register_source("interrupt")
class InterruptSource(OldLogpSource):
    keeps_versions = True
    exact = True
    needs_interrupt = True

    def compute(self, rb, version: int):
        check_single_version(rb)
        return score_by_version(self.ctx.policy, self.store, rb, version, self.ctx.temperature)
