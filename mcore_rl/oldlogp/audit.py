"""The missing-old-logit error: mean |old_logp - exact old_logp| on a sampled fraction of a round's rows.

`exact` scores each token under the weights of the version that generated it (store.score_by_version): the
current version's tokens with the live weights, older ones with the stored copies, so the cost is one forward of
the sampled rows per distinct stale version. Rows are drawn with a generator seeded by (seed, round) so every
rank draws the same rows (the forwards are collective). The value is computed on the last pipeline stage and
max-reduced over the world, so rank 0 (which logs) sees it under PP too.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mcore_rl.distributed import all_reduce
from mcore_rl.oldlogp.store import VersionStore, score_by_version


class Auditor:
    def __init__(self, frac: float, seed: int) -> None:
        if not 0.0 < frac <= 1.0:
            raise ValueError(f"algorithm.old_logp_audit_frac must be in [0, 1], got {frac}")
        self.frac, self.seed, self.rounds = float(frac), int(seed), 0

    def rows(self, n: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rounds)
        self.rounds += 1
        k = max(1, round(self.frac * n))
        return sorted(torch.randperm(n, generator=g)[:k].tolist())

    def measure(self, policy, store: VersionStore, rb, old_logp: Tensor | None, version: int,
                temperature: float) -> dict[str, float]:
        rows = self.rows(len(rb))
        sub = rb.select(rows)
        exact = score_by_version(policy, store, sub, version, temperature)
        stats = torch.zeros(3, dtype=torch.float64)  # mean, max, stale-token fraction
        if exact is not None and old_logp is not None:
            m = sub.loss_mask > 0
            diff = (old_logp[rows] - exact).abs()[m].to(torch.float64)
            if diff.numel():
                stale = (sub.versions[m] != version).to(torch.float64)
                stats = torch.stack([diff.mean(), diff.max(), stale.mean()])
        stats = all_reduce(stats, "max")
        return {"old_logp_error": stats[0].item(), "old_logp_error_max": stats[1].item(),
                "old_logp_stale_token_frac": stats[2].item()}
