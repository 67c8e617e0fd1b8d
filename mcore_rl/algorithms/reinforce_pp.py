"""REINFORCE++ (Hu et al. 2025, arXiv 2501.03262) and its `baseline` variant: no critic, no per-prompt std.

Per response i of length n_i (policy tokens), outcome reward R_i, and token t:
    a_i = R_i                      (baseline: none, REINFORCE++)
    a_i = R_i - mean_G R           (baseline: group, REINFORCE++-baseline; groups of >= 2)
    mu, sigma = token-weighted mean and std of a over the whole global batch (every DP rank, the Reducer)
    A_it = (a_i - mu) / (sigma + eps) - beta * sum_{s >= t} m_s kl_s
    kl_s = k1: log pi_old - log pi_ref | k2: (log pi_old - log pi_ref)^2 / 2 | k3: Schulman's (detached)
    l_it = -min(r A_it, clip(r, 1 - eps_low, 1 + eps_high) A_it),  r = pi_theta / pi_old,  token-mean
The KL term is OpenRLHF's token-level KL reward -beta kl_s summed into the return with gamma = 1: each token is
charged the KL of itself and every later policy token of its response (tool tokens, m = 0, carry none).

Where the KL return enters, and why: OpenRLHF whitens the whole return a - beta K_t; here the outcome part a is
whitened (exact, over the global batch, before the first micro-batch) and the KL return is added after it.
Reference log-probs reach an algorithm one micro-batch at a time, and a mean subtracted under the PPO clip cannot be
deferred to the end of the step (it decides each token's clip branch), so statistics over the KL part would make
the loss depend on the micro-batch split. Nor is the KL return divided by the outcome's sigma: when every outcome
of a batch is equal (late in a verifiable-reward run) sigma is ~0 and the KL would be multiplied by 1 / eps. So beta
is in units of the whitened advantage rather than of the reward, and there is no mean shift beta mean(K).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from mcore_rl.algorithms.advantages import (
    AdvantageResult,
    advantage_result,
    group_stats,
    refuse_singleton_groups,
)
from mcore_rl.algorithms.base import PolicyTerms, TokenBatch
from mcore_rl.algorithms.correction import check_choice
from mcore_rl.algorithms.grpo import GRPO, GrpoConfig
from mcore_rl.algorithms.ops import KL_CLAMP, log_ratio, masked_mean
from mcore_rl.algorithms.reduce import Reducer, identity_reduce, stack_sums
from mcore_rl.algorithms.registry import register_algorithm

BASELINES = ("none", "group")
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass
class ReinforcePPConfig(GrpoConfig):
    name: str = "reinforce_pp"
    updates_per_rollout: int = 1
    loss_agg_mode: str = "token-mean"  # OpenRLHF's token-level loss
    kl_coef: float = 0.0               # KL as a per-token k3 loss (the shared term); 0: the KL is in the return
    adv_std_norm: str = "batch"        # batch: whiten (mean and std) | none: subtract the global mean only
    adv_std_unbiased: bool = False     # OpenRLHF's whitening divides by the token count
    baseline: str = "none"             # none: REINFORCE++ | group: REINFORCE++-baseline (group mean first)
    reward_kl_coef: float = 0.01       # beta of the token-level KL folded into the return (0: no reference model)
    reward_kl_estimator: str = "k1"    # k1 | k2 | k3 estimate of KL(pi_old || pi_ref) per token

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = f"algorithm {self.name!r}"
        check_choice(owner, "baseline", self.baseline, BASELINES)
        check_choice(owner, "reward_kl_estimator", self.reward_kl_estimator, KL_ESTIMATORS)
        check_choice(owner, "adv_std_norm", self.adv_std_norm, ("batch", "none"))
        if not self.reward_kl_coef >= 0:
            raise ValueError(f"{owner}: reward_kl_coef must be >= 0, got {self.reward_kl_coef}")


def kl_estimate(logp: Tensor, ref_logp: Tensor, mask: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi || ref) on samples of pi, 0 off the mask; the log-ratio is clamped to +-10."""
    x = log_ratio(logp, ref_logp, mask, KL_CLAMP)  # log pi - log ref
    if estimator == "k1":
        return x
    if estimator == "k2":
        return 0.5 * x * x
    if estimator == "k3":
        return torch.expm1(-x) + x
    raise ValueError(f"reward_kl_estimator={estimator!r} is not one of {list(KL_ESTIMATORS)}")


def kl_returns(kl: Tensor, mask: Tensor) -> Tensor:
    """K_t = sum_{s >= t} m_s kl_s along each row: the KL part of the gamma = 1 return from token t on."""
    k = torch.where(mask > 0, kl, torch.zeros_like(kl))
    return k.flip(1).cumsum(dim=1).flip(1)


def token_whiten(values: Tensor, lengths: Tensor, keep: Tensor, reduce: Reducer = identity_reduce,
                 eps: float = 1e-6, unbiased: bool = False, divide: bool = True) -> tuple[Tensor, float, float]:
    """((values - mu) / (sigma + eps), mu, sigma + eps): the statistics of a per-response value counted once per
    policy token of the kept responses, over every rank (one all-reduce of three sums). `divide=False`: centre
    only (the scale returned is 1). The mean of a token-level return, whose outcome part is constant along a
    response, is this length-weighted mean."""
    v = values.to(torch.float64)
    n = lengths.to(torch.float64) * keep.to(torch.float64)
    tot, s1, s2 = reduce(stack_sums(n.sum(), (n * v).sum(), (n * v * v).sum(), device=v.device)).tolist()
    if tot <= 0:
        return torch.zeros_like(v), 0.0, 1.0
    mu = s1 / tot
    if not divide:
        return v - mu, mu, 1.0
    denom = tot - 1 if unbiased and tot > 1 else tot
    scale = math.sqrt(max(s2 - tot * mu * mu, 0.0) / denom) + eps
    return (v - mu) / scale, mu, scale


@register_algorithm("reinforce_pp")
class ReinforcePP(GRPO):
    config_cls = ReinforcePPConfig
    config: ReinforcePPConfig
    skips_inert_rows = True  # rows with A = 0 and no KL in the return or loss carry no gradient

    @property
    def needs_ref_logp(self) -> bool:
        return super().needs_ref_logp or self.config.reward_kl_coef > 0

    def advantages(self, rewards: Tensor, group_ids: Tensor, reduce: Reducer = identity_reduce,
                   lengths: Tensor | None = None) -> AdvantageResult:
        """Outcome advantages whitened over the global batch's policy tokens (`lengths` per response)."""
        c = self.config
        if lengths is None:
            raise ValueError(f"algorithm {self.name!r}: the token-level whitening needs response lengths")
        r = self.shaped_rewards(rewards.detach().to(torch.float64), lengths)
        st = group_stats(r, group_ids, c.adv_std_unbiased)
        a = r
        if c.baseline == "group":
            refuse_singleton_groups(group_ids, f"algorithm {self.name!r} (baseline=group)")
            a = r - st.mean
        keep = ~st.zero_var if c.filter_zero_variance else torch.ones_like(st.zero_var)
        adv, mu, scale = token_whiten(a, lengths, keep, reduce, c.adv_eps, c.adv_std_unbiased,
                                      divide=c.adv_std_norm == "batch")
        res = advantage_result(r, adv, keep, st)
        res.metrics.update(whiten_mean=mu, whiten_std=scale)
        return res

    def policy_terms(self, batch: TokenBatch, reduce: Reducer) -> PolicyTerms:
        c, m = self.config, batch.mask
        if c.reward_kl_coef == 0:
            return super().policy_terms(batch, reduce)
        anchor = self.anchor_logp(batch).detach()
        kl = kl_estimate(anchor, batch.ref_logp, m, c.reward_kl_estimator)
        adv = batch.advantages - c.reward_kl_coef * kl_returns(kl, m)
        loss, _, metrics = self.clip_terms(replace(batch, advantages=adv), anchor)
        metrics["reward_kl"] = masked_mean(kl, m)
        return PolicyTerms(pg=loss, metrics=metrics)

    def inert_rows(self, advantages: Tensor, weights: Tensor) -> Tensor | None:
        """With the KL in the return a row of A = 0 still has a gradient: only rows without weight are inert."""
        inert = super().inert_rows(advantages, weights)
        if inert is None or self.config.reward_kl_coef == 0:
            return inert
        return inert & (weights == 0).all(dim=1)
