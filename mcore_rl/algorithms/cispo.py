"""CISPO loss and the ScaleRL recipe built on it.

CISPO is REINFORCE with a truncated, detached importance weight:
    l_t = -sg(clamp(rho_t, eps_min, eps_max)) * A * logp_theta,     rho = pi_train / pi_gen
Unlike PPO's clip the gradient never vanishes: a token with rho = 7 still gets -eps_max * A * grad logp.
eps_max = 5 (TRL's ScaleRL value, an absolute bound); eps_min = 0 means no lower truncation (slime's
--eps-clip 1.0). pi_gen is the generator's log-prob (old_logp_source=rollout), which under PipelineRL may mix
weight versions inside one response.

ScaleRL = CISPO + prompt-level aggregation + batch-level advantage normalisation (A = R - mean_G R, divided by
one std over the global batch) + zero-variance filtering + no-positive-resampling (retire prompts with pass rate
>= 0.9; the data sampler consults pass_rate.PassRateHistory) + PipelineRL-8. The truncation rate is logged
because a high value warns of instability.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_rl.algorithms.base import Algorithm, AlgorithmConfig, PolicyTerms, TokenBatch
from mcore_rl.algorithms.ops import log_ratio, masked_mean
from mcore_rl.algorithms.reduce import Reducer
from mcore_rl.algorithms.registry import register_algorithm


@dataclass
class CispoConfig(AlgorithmConfig):
    name: str = "cispo"
    old_logp_source: str = "rollout"
    eps_max: float = 5.0               # absolute upper truncation of the IS weight
    eps_min: float = 0.0               # absolute lower truncation (0 = none)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.eps_min < self.eps_max:
            raise ValueError(f"algorithm {self.name!r}: need 0 <= eps_min < eps_max, "
                             f"got eps_min={self.eps_min}, eps_max={self.eps_max}")


@register_algorithm("cispo")
class CISPO(Algorithm):
    config_cls = CispoConfig
    config: CispoConfig
    sum_keys = ("trunc_tokens",)  # a metric only: no decision reads it
    skips_inert_rows = True  # -sg(clip(rho)) x A x logp; ScaleRL inherits it

    def policy_terms(self, batch: TokenBatch, reduce: Reducer) -> PolicyTerms:
        c, m = self.config, batch.mask
        log_rho = log_ratio(batch.logp, self.anchor_logp(batch), m).detach()
        rho = torch.exp(log_rho)
        coef = rho.clamp(c.eps_min, c.eps_max)
        pg = -coef * batch.advantages * batch.logp
        trunc = ((rho > c.eps_max) | (rho < c.eps_min)) & (m > 0)
        metrics = {
            "cispo_trunc_frac": masked_mean(trunc.to(rho.dtype), m),
            "ratio_mean": masked_mean(rho, m),
            "ppo_kl": masked_mean(-log_rho, m),
        }
        return PolicyTerms(pg=pg, metrics=metrics, sums={"trunc_tokens": trunc.sum()})

    def step_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return {"cispo_trunc_frac": sums["trunc_tokens"] / max(sums["tok_total"], 1.0)}


@dataclass
class ScaleRLConfig(CispoConfig):
    name: str = "scalerl"
    schedule: str = "async"
    max_staleness: int = 8             # PipelineRL-8
    loss_agg_mode: str = "prompt-mean"
    adv_std_norm: str = "batch"
    batch_std_source: str = "advantages"  # paper reading; TRL uses the std of raw rewards ("rewards")
    filter_zero_variance: bool = True
    retire_pass_rate: float | None = 0.9


@register_algorithm("scalerl")
class ScaleRL(CISPO):
    config_cls = ScaleRLConfig
