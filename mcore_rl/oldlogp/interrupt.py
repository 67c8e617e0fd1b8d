"""`interrupt`: every weight update restarts the samples in flight from their prompt under the new weights (the
engine's interrupt mode), so each sample's tokens all come from one version and the engine's log-probs are
coherent per sample. The old log-probs are that version's: scored from the version store, one forward per
distinct version in the round (a sample never needs two)."""

from __future__ import annotations

from mcore_rl.oldlogp.base import OldLogpSource
from mcore_rl.oldlogp.registry import register_source
from mcore_rl.oldlogp.store import score_by_version


def turn_spans(mask) -> list[tuple[int, int]]:
    """[start, end) of each contiguous run of policy tokens in one row: a model turn (one per single-turn row)."""
    pos = (mask > 0).nonzero().flatten().tolist()
    spans: list[tuple[int, int]] = []
    for p in pos:
        if spans and spans[-1][1] == p:
            spans[-1] = (spans[-1][0], p + 1)
        else:
            spans.append((p, p + 1))
    return spans


def check_single_version(rb) -> None:
    """Every model turn (a contiguous run of policy tokens) carries one version. The engine restarts a turn in
    flight at a weight update, so a multi-turn episode may hold several versions, one per turn, never two in a
    turn."""
    bad = []
    for i in range(len(rb)):
        for a, b in turn_spans(rb.loss_mask[i]):
            if len(set(rb.versions[i, a:b].tolist())) > 1:
                bad.append(i)
                break
    if bad:
        raise RuntimeError(f"old_logp_source interrupt: rows {bad[:5]} have a turn that spans several weight "
                           "versions; the engine did not restart it at a weight update")


@register_source("interrupt")
class InterruptSource(OldLogpSource):
    keeps_versions = True
    exact = True
    needs_interrupt = True

    def compute(self, rb, version: int):
        check_single_version(rb)
        return score_by_version(self.ctx.policy, self.store, rb, version, self.ctx.temperature)
