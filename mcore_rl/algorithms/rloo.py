"""RLOO (Ahmadian et al. 2024, "Back to Basics"): REINFORCE with a leave-one-out baseline and a PPO-clipped ratio.

Advantage (advantages.py `leave_one_out_advantages`), for the G >= 2 responses of a prompt:
    A_i = R_i - mean_{j != i} R_j = G/(G-1) (R_i - mean_G R)          no std division by default
Loss, with the whole response as one action (`ratio_level: sequence`, TRL's RLOOTrainer):
    rho_i = exp(sum_t m_t (logp_t - logp_anchor_t)),   l_i = -min(rho_i A_i, clip(rho_i, 1 - eps_low, 1 + eps_high) A_i)
placed on every counted token of response i and aggregated `seq-mean-token-mean`, so the step loss is the mean of
l_i over responses. On-policy (rho = 1) its gradient is -(1/N) sum_i A_i grad log pi(y_i): the unbiased RLOO
estimator, not length-normalised. `ratio_level: token` takes GRPO's per-token clipped surrogate instead
(OpenRLHF's `rloo`). A KL to a reference is the shared per-token k3 loss (`kl_coef`, default 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mcore_rl.algorithms.advantages import AdvantageResult, leave_one_out_advantages
from mcore_rl.algorithms.base import PolicyTerms, TokenBatch
from mcore_rl.algorithms.correction import check_choice
from mcore_rl.algorithms.grpo import GRPO, GrpoConfig, ppo_clip_loss
from mcore_rl.algorithms.ops import LOG_RATIO_CLAMP, log_ratio, masked_mean
from mcore_rl.algorithms.reduce import Reducer, identity_reduce
from mcore_rl.algorithms.registry import register_algorithm

RATIO_LEVELS = ("sequence", "token")


@dataclass
class RlooConfig(GrpoConfig):
    name: str = "rloo"
    updates_per_rollout: int = 1       # TRL's num_iterations = 1: on-policy REINFORCE unless raised
    kl_coef: float = 0.0               # no reference model (and no reference forward) unless asked for
    adv_std_norm: str = "none"         # none | batch (TRL's normalize_advantages)
    ratio_level: str = "sequence"      # sequence: one ratio per response (TRL) | token: GRPO's per-token clip

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = f"algorithm {self.name!r}"
        check_choice(owner, "ratio_level", self.ratio_level, RATIO_LEVELS)
        check_choice(owner, "adv_std_norm", self.adv_std_norm, ("none", "batch"))


def sequence_log_ratio(logp: Tensor, anchor: Tensor, mask: Tensor) -> Tensor:
    """[B] log of the response's importance ratio, sum_t m_t (logp_t - anchor_t), clamped like a token's."""
    return log_ratio(logp, anchor, mask).sum(dim=1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def row_values(x: Tensor, mask: Tensor) -> Tensor:
    """[B] the per-response value broadcast over its counted tokens (0 for a row without any)."""
    m = (mask > 0).to(x.dtype)
    return (x * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)


@register_algorithm("rloo")
class RLOO(GRPO):
    config_cls = RlooConfig
    config: RlooConfig
    skips_inert_rows = True  # l_i = A_i x (ratio term): a row with A = 0 adds nothing at either ratio level

    def advantages(self, rewards: Tensor, group_ids: Tensor, reduce: Reducer = identity_reduce,
                   lengths: Tensor | None = None) -> AdvantageResult:
        """Leave-one-out advantages; a group of one response is refused (ConfigError: one line, exit 2)."""
        c = self.config
        rewards = self.shaped_rewards(rewards, lengths)
        return leave_one_out_advantages(rewards, group_ids, std_norm=c.adv_std_norm, eps=c.adv_eps,
                                        unbiased=c.adv_std_unbiased, filter_zero_variance=c.filter_zero_variance,
                                        reduce=reduce, owner=self.name)

    def policy_terms(self, batch: TokenBatch, reduce: Reducer) -> PolicyTerms:
        if self.config.ratio_level == "token":
            return super().policy_terms(batch, reduce)
        c, m = self.config, batch.mask
        log_r = sequence_log_ratio(batch.logp, self.anchor_logp(batch), m)
        loss, clip_active, dual_active = ppo_clip_loss(log_r, row_values(batch.advantages, m), c.eps_low,
                                                       c.eps_high, c.dual_clip_c)
        f, lr = log_r.dtype, log_r.detach()[:, None].expand_as(m)  # per-response values, counted per token
        metrics = {
            "pg_clipfrac": masked_mean(clip_active.to(f)[:, None].expand_as(m), m),
            "pg_clipfrac_lower": masked_mean(dual_active.to(f)[:, None].expand_as(m), m),
            "ppo_kl": masked_mean(-log_ratio(batch.logp.detach(), self.anchor_logp(batch), m), m),
            "ratio_mean": masked_mean(torch.exp(lr), m),  # the response ratio the clip acts on
        }
        return PolicyTerms(pg=loss[:, None].expand_as(m), metrics=metrics)
