"""GRPO and its presets DAPO and Dr.GRPO: one clipped-surrogate loss, three sets of defaults.

Per token, with r = exp(logp - logp_anchor) and a sequence advantage A:
    l = -min(r*A, clip(r, 1 - eps_low, 1 + eps_high)*A)      (+ optional dual clip: min(l, -c*A) when A < 0)
KL to a reference and the entropy bonus are added by the base class. The anchor is the trainer's recompute
(old_logp_source=recompute|snapshot) or the rollout engine's log-probs (old_logp_source=rollout, "bypass").

- GRPO:    eps 0.2/0.2, group z-score, seq-mean-token-mean, kl_coef 0.001.
- DAPO:    clip-higher eps 0.2/0.28, zero-variance filtering + dynamic sampling, token-mean, soft overlong
           penalty, no KL.
- Dr.GRPO: A = R - mean_G R (no std), seq-mean-token-sum-norm with constant L_max, no KL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mcore_rl.algorithms.base import Algorithm, AlgorithmConfig, PolicyTerms, TokenBatch
from mcore_rl.algorithms.ops import log_ratio, masked_mean
from mcore_rl.algorithms.reduce import Reducer
from mcore_rl.algorithms.registry import register_algorithm


def ppo_clip_loss(log_r: Tensor, adv: Tensor, eps_low: float, eps_high: float,
                  dual_clip_c: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Clipped surrogate per token; returns (loss, clipped-branch-active, dual-clip-active)."""
    r = torch.exp(log_r)
    unclipped = -adv * r
    clipped = -adv * r.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    if dual_clip_c is None:
        return loss, clip_active, torch.zeros_like(clip_active)
    cap = -adv * dual_clip_c
    dual_active = (adv < 0) & (loss > cap)
    return torch.where(dual_active, cap, loss), clip_active, dual_active


@dataclass
class GrpoConfig(AlgorithmConfig):
    name: str = "grpo"
    schedule: str = "sync"
    updates_per_rollout: int = 4
    loss_agg_mode: str = "seq-mean-token-mean"
    kl_coef: float = 0.001
    eps_low: float = 0.2               # ratio clip [1 - eps_low, 1 + eps_high]
    eps_high: float = 0.2
    dual_clip_c: float | None = None   # dual clip for A < 0 (verl uses 3.0); null = off

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (0 <= self.eps_low <= 1 and self.eps_high >= 0):
            raise ValueError(f"algorithm {self.name!r}: need 0 <= eps_low <= 1 and eps_high >= 0, "
                             f"got eps_low={self.eps_low}, eps_high={self.eps_high}")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            raise ValueError(f"algorithm {self.name!r}: dual_clip_c must be > 1 or null, got {self.dual_clip_c}")


@register_algorithm("grpo")
class GRPO(Algorithm):
    config_cls = GrpoConfig
    config: GrpoConfig
    skips_inert_rows = True  # the clipped surrogate is A x (ratio term); DAPO and Dr.GRPO inherit it

    def clip_terms(self, batch: TokenBatch, anchor: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Clipped surrogate against `anchor`, the log-ratio (for subclasses) and the PPO metrics."""
        c, m = self.config, batch.mask
        log_r = log_ratio(batch.logp, anchor, m)
        loss, clip_active, dual_active = ppo_clip_loss(log_r, batch.advantages, c.eps_low, c.eps_high, c.dual_clip_c)
        f = log_r.dtype
        metrics = {
            "pg_clipfrac": masked_mean(clip_active.to(f), m),
            "pg_clipfrac_lower": masked_mean(dual_active.to(f), m),
            "ppo_kl": masked_mean(-log_r.detach(), m),
            "ratio_mean": masked_mean(torch.exp(log_r.detach()), m),
        }
        return loss, log_r, metrics

    def policy_terms(self, batch: TokenBatch, reduce: Reducer) -> PolicyTerms:
        loss, _, metrics = self.clip_terms(batch, self.anchor_logp(batch))
        return PolicyTerms(pg=loss, metrics=metrics)


@dataclass
class DapoConfig(GrpoConfig):
    name: str = "dapo"
    eps_high: float = 0.28
    loss_agg_mode: str = "token-mean"
    kl_coef: float = 0.0
    filter_zero_variance: bool = True
    dynamic_sampling: bool = True
    max_response_len: int | None = 20480
    overlong_buffer_len: int = 4096
    overlong_penalty_factor: float = 1.0


@register_algorithm("dapo")
class DAPO(GRPO):
    config_cls = DapoConfig


@dataclass
class DrGrpoConfig(GrpoConfig):
    name: str = "dr_grpo"
    adv_std_norm: str = "none"
    loss_agg_mode: str = "seq-mean-token-sum-norm"
    max_response_len: int | None = 4096
    kl_coef: float = 0.0


@register_algorithm("dr_grpo")
class DrGRPO(GRPO):
    config_cls = DrGrpoConfig
