"""P3O: an ESS-adaptive off-policy objective with no new hyper-parameters.

With w_t = exp(logp_theta - logp_b) (b = behaviour = rollout engine log-probs) over the valid tokens,
    ESS = (sum w)^2 / (n * sum w^2 + 1e-8)            in (0, 1], 1 when all ratios are equal (scale-invariant)
    l_t = -sg(min(w_t, ESS)) * A * logp_theta + (1 - ESS) * k3(theta || b)_t
The first term is REINFORCE with a truncated, detached IS weight whose cap is ESS itself: every token's weight
shrinks as the batch drifts off-policy, yet high-ratio tokens keep a gradient of ESS * |A| (PPO would zero it).
The (1 - ESS)-weighted KL to the behaviour policy is the adaptive trust region. eps_low/eps_high only feed the
clipfrac metric.

ESS scope (`ess_scope`):
- microbatch (reference code): sums over the current micro-batch, all-reduced across DP ranks in float64. This
  issues one collective per micro-batch (all ranks need the same number of micro-batches) and makes the loss
  depend on the micro-batch split.
- batch: ESS over the whole update's global batch. The trainer (update.run_update) runs one no-grad forward over
  the update's local rows before the first micro-batch loss and calls begin_step(), which all-reduces the sums
  over DP (compute_ess) and sets the value (set_batch_ess); the loss is then split-invariant, at the cost of that
  extra forward per update. The value is consumed by finish_accumulation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mcore_rl.algorithms.base import Algorithm, AlgorithmConfig, PolicyTerms, TokenBatch
from mcore_rl.algorithms.correction import check_choice
from mcore_rl.algorithms.ops import k3, log_ratio, masked_mean
from mcore_rl.algorithms.reduce import Reducer, identity_reduce, stack_sums
from mcore_rl.algorithms.registry import register_algorithm

ESS_SCOPES = ("microbatch", "batch")


@torch.no_grad()
def compute_ess(logp: Tensor, behaviour_logp: Tensor, mask: Tensor, reduce: Reducer = identity_reduce,
                eps: float = 1e-8) -> float:
    """Global token ESS of w = pi_theta / pi_b over valid tokens, float64 sums; 1.0 if empty or non-finite."""
    w = torch.exp(log_ratio(logp.detach(), behaviour_logp, mask).to(torch.float64))
    m = (mask > 0).to(torch.float64)
    s1, s2, n = reduce(stack_sums((w * m).sum(), (w * w * m).sum(), m.sum(), device=w.device)).tolist()
    if n == 0 or not all(math.isfinite(v) for v in (s1, s2)):
        return 1.0
    ess = s1 * s1 / (n * s2 + eps)
    return ess if math.isfinite(ess) else 1.0


@dataclass
class P3oConfig(AlgorithmConfig):
    name: str = "p3o"
    schedule: str = "sync"             # the loss is the same sync or async (max_staleness applies to async)
    updates_per_rollout: int = 4
    max_staleness: int = 2
    old_logp_source: str = "rollout"   # the behaviour policy is the rollout engine's; no recompute
    loss_agg_mode: str = "token-mean"
    ess_scope: str = "microbatch"      # microbatch | batch (see module docstring)
    ess_eps: float = 1e-8
    eps_low: float = 0.2               # metric only: clipfrac = ratio outside [1 - eps_low, 1 + eps_high]
    eps_high: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice(f"algorithm {self.name!r}", "ess_scope", self.ess_scope, ESS_SCOPES)


@register_algorithm("p3o")
class P3O(Algorithm):
    config_cls = P3oConfig
    config: P3oConfig

    def __init__(self, config: P3oConfig) -> None:
        super().__init__(config)
        self._batch_ess: float | None = None

    @property
    def needs_step_logp(self) -> bool:
        return self.config.ess_scope == "batch"

    def begin_step(self, logp: Tensor, anchor: Tensor, mask: Tensor, reduce: Reducer = identity_reduce,
                   ) -> dict[str, float]:
        """ess_scope=batch: ESS of the update's whole batch at the current weights, all-reduced over DP."""
        ess = compute_ess(logp, anchor, mask, reduce, self.config.ess_eps)
        self.set_batch_ess(ess)
        return {"ess_batch": ess}

    def set_batch_ess(self, ess: float) -> None:
        """ess_scope=batch: the global ESS to use for this step's micro-batches (see compute_ess)."""
        if not 0 < ess <= 1 + 1e-6:
            raise ValueError(f"P3O batch ESS must be in (0, 1], got {ess}")
        self._batch_ess = float(ess)

    def _ess(self, batch: TokenBatch, anchor: Tensor, reduce: Reducer) -> float:
        if self.config.ess_scope == "microbatch":
            return compute_ess(batch.logp, anchor, batch.mask, reduce, self.config.ess_eps)
        if self._batch_ess is None:
            raise RuntimeError("P3O ess_scope=batch: call set_batch_ess(compute_ess(...)) before the step's loss")
        return self._batch_ess

    def policy_terms(self, batch: TokenBatch, reduce: Reducer) -> PolicyTerms:
        c, m = self.config, batch.mask
        anchor = self.anchor_logp(batch)
        ess = self._ess(batch, anchor, reduce)
        log_w = log_ratio(batch.logp, anchor, m).detach()
        w = torch.exp(log_w)
        coef = w.clamp(max=ess)
        pg = -coef * batch.advantages * batch.logp
        kl_b = k3(batch.logp, anchor, m)
        f = w.dtype
        metrics = {
            "ess_factor": ess,
            "clipfrac": masked_mean(((w < 1 - c.eps_low) | (w > 1 + c.eps_high)).to(f), m),
            "capped_frac": masked_mean((w > ess).to(f), m),
            "approx_kl": masked_mean(w - 1 - log_w, m),
            "kl_behavioral": masked_mean(kl_b.detach(), m),
            "ratio_mean": masked_mean(w, m),
        }
        return PolicyTerms(pg=pg, reg=(1.0 - ess) * kl_b, metrics=metrics)

    def finish_accumulation(self, reduce: Reducer = identity_reduce):
        self._batch_ess = None
        return super().finish_accumulation(reduce)
