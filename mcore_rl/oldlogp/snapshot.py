"""`snapshot`: host copies of every version an unconsumed token can reference (k + 1 of them under async k);
each token is scored under the version that produced it (store.score_by_version)."""

from __future__ import annotations

from mcore_rl.oldlogp.base import OldLogpSource
from mcore_rl.oldlogp.registry import register_source
from mcore_rl.oldlogp.store import score_by_version


@register_source("snapshot")
class SnapshotSource(OldLogpSource):
    keeps_versions = True
    exact = True

    def compute(self, rb, version: int):
        return score_by_version(self.ctx.policy, self.store, rb, version, self.ctx.temperature)
