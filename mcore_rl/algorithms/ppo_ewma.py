"""PPO-EWMA with decoupled train-infer correction (the revised PPO-EWMA of arXiv 2605.12070).

Without an exact pi_old (delayed updates, partial rollouts) the proximal policy pi_prox = pi_{theta_bar} (EWMA
of past weights, see ewma.py) takes its place, and the ratio pi_theta / pi_infer splits into
    d_t = pi_prox / pi_infer    training-inference discrepancy  -> Train-Infer Mask  1[ti_low <= d <= ti_high]
    s_t = pi_theta / pi_prox    policy staleness                -> PPO clip [1 - eps_low, 1 + eps_high]
    l_t = -M_t * min(s_t * A, clip(s_t) * A)    (optionally times min(d_t, ti_tis_max))
d is taken at `ti_level` (token | sequence | geometric). The grid in the paper (eps ~ 1.002-1.006) suggests tight
geometric bounds, hence the defaults [0.995, 1.005]; both the level and the bounds are unknown, so configurable.

objective=original is Hilton et al.'s PPO-EWMA: -(pi_prox / pi_behav) * min(s A, clip(s) A), with the behaviour
log-prob floored at logp_theta - log(imp_samp_max) so the weight is at most imp_samp_max.

Automatic reset: when the global Train-Infer keep-rate of a step falls below `reset_keep_rate`, the
after_optimizer_step hook returns reset_ewma=True and the trainer calls EwmaWeights.reset(params).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mcore_rl.algorithms.base import Algorithm, AlgorithmConfig, PolicyTerms, StepDecision, TokenBatch
from mcore_rl.algorithms.correction import LEVELS, check_choice, level_log_ratio
from mcore_rl.algorithms.ewma import EwmaWeights
from mcore_rl.algorithms.grpo import ppo_clip_loss
from mcore_rl.algorithms.ops import log_ratio, masked_mean
from mcore_rl.algorithms.reduce import Reducer
from mcore_rl.algorithms.registry import register_algorithm

OBJECTIVES = ("decoupled", "original")


@dataclass
class PpoEwmaConfig(AlgorithmConfig):
    name: str = "ppo_ewma"
    schedule: str = "sync"             # the loss is the same sync or async (max_staleness applies to async)
    updates_per_rollout: int = 4
    max_staleness: int = 2
    old_logp_source: str = "rollout"   # pi_old is replaced by the EWMA proximal policy
    loss_agg_mode: str = "token-mean"
    ewma_beta: float = 0.75            # studied: 0.4, 0.5, 0.75
    objective: str = "decoupled"       # decoupled | original
    eps_low: float = 0.2               # staleness clip of s = pi_theta / pi_prox
    eps_high: float = 0.2
    dual_clip_c: float | None = None
    ti_level: str = "geometric"        # token | sequence | geometric
    ti_low: float = 0.995              # Train-Infer Mask keeps low <= d <= high
    ti_high: float = 1.005
    ti_tis_max: float | None = None    # optional: also multiply by min(d, ti_tis_max)
    imp_samp_max: float = 100.0        # objective=original: cap of pi_prox / pi_behav
    auto_reset: bool = True
    reset_keep_rate: float = 0.5       # reset the EWMA when the step's keep-rate drops below this (unknown)

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = f"algorithm {self.name!r}"
        check_choice(owner, "objective", self.objective, OBJECTIVES)
        check_choice(owner, "ti_level", self.ti_level, LEVELS)
        if not 0.0 <= self.ewma_beta < 1.0:
            raise ValueError(f"{owner}: ewma_beta must be in [0, 1), got {self.ewma_beta}")
        if not 0 <= self.ti_low <= 1 <= self.ti_high:
            raise ValueError(f"{owner}: need 0 <= ti_low <= 1 <= ti_high, got {self.ti_low}, {self.ti_high}")
        if not 0 <= self.reset_keep_rate <= 1:
            raise ValueError(f"{owner}: reset_keep_rate must be in [0, 1], got {self.reset_keep_rate}")
        if self.imp_samp_max <= 1:
            raise ValueError(f"{owner}: imp_samp_max must be > 1, got {self.imp_samp_max}")


@register_algorithm("ppo_ewma")
class PPOEWMA(Algorithm):
    config_cls = PpoEwmaConfig
    config: PpoEwmaConfig
    sum_keys = ("ti_kept",)

    def __init__(self, config: PpoEwmaConfig) -> None:
        super().__init__(config)
        self.last_keep_rate: float | None = None
        self.num_resets = 0

    @property
    def needs_prox_logp(self) -> bool:
        return True

    def make_ewma(self, params: Sequence[Tensor]) -> EwmaWeights:
        """The proximal weights the trainer keeps (update after each step, reset on request)."""
        return EwmaWeights(params, self.config.ewma_beta)

    def policy_terms(self, batch: TokenBatch, reduce: Reducer) -> PolicyTerms:
        c, m = self.config, batch.mask
        prox, infer = batch.prox_logp, batch.rollout_logp
        log_s = log_ratio(batch.logp, prox, m)
        loss, clip_active, dual_active = ppo_clip_loss(log_s, batch.advantages, c.eps_low, c.eps_high,
                                                       c.dual_clip_c)
        f = log_s.dtype
        with torch.no_grad():
            log_d = level_log_ratio(log_ratio(prox, infer, m), m, c.ti_level)
            d = torch.exp(log_d)
            ti_keep = (d >= c.ti_low) & (d <= c.ti_high) & (m > 0)
        metrics = {
            "pg_clipfrac": masked_mean(clip_active.to(f), m),
            "pg_clipfrac_lower": masked_mean(dual_active.to(f), m),
            "ppo_kl": masked_mean(-log_s.detach(), m),
            "ti_keep_rate": masked_mean(ti_keep.to(f), m),
            "ti_ratio_mean": masked_mean(d, m),
        }
        sums = {"ti_kept": ti_keep.sum()}
        if c.objective == "original":
            log_behav = torch.maximum(infer, batch.logp.detach() - math.log(c.imp_samp_max))
            weight = torch.exp(log_ratio(prox, log_behav, m)).detach()
            return PolicyTerms(pg=weight * loss, metrics=metrics, sums=sums)
        if c.ti_tis_max is not None:
            loss = loss * d.clamp(max=c.ti_tis_max)
        return PolicyTerms(pg=loss, keep=ti_keep.to(f), metrics=metrics, sums=sums)

    def step_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        self.last_keep_rate = sums["ti_kept"] / sums["tok_total"] if sums["tok_total"] else 1.0
        return {"ti_keep_rate": self.last_keep_rate}

    def state_dict(self) -> dict[str, float | int | None]:
        return {"num_resets": self.num_resets, "last_keep_rate": self.last_keep_rate}

    def after_optimizer_step(self, metrics: dict[str, float]) -> StepDecision:
        """Ask for an EWMA reset when the Train-Infer keep-rate of the step fell below the floor."""
        rate = metrics.get("ti_keep_rate", self.last_keep_rate)
        reset = (self.config.auto_reset and self.config.objective == "decoupled" and rate is not None
                 and rate < self.config.reset_keep_rate)
        self.num_resets += int(reset)
        return StepDecision(reset_ewma=reset, metrics={"ewma_reset": float(reset),
                                                       "ewma_resets_total": float(self.num_resets)})
