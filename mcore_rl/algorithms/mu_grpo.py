"""Mu-GRPO: many updates per rollout (staged schedule) made stable by relaxed clipping and a veto.

Ratios are taken against the stored behaviour log-probs (old_logp_source=rollout by default, since the rollout
engine is released while a stage trains). The token loss is GRPO's with a relaxed clip [1 - eps_low,
1 + eps_high] = [0, 5], so negative-advantage tokens are never clipped and positive ones only above 5.

Negative-advantage veto (NAV): for a response with A < 0, trigger tokens are T = {t : rho_t < delta}, where rho
is evaluated at the current parameters on every forward (detached). With kappa = the first trigger position,
the vetoed set V is one of
    S_kappa   tokens after kappa to the end (default; kappa itself excluded)
    H_kappa   S_kappa minus the triggers themselves
    seq       the whole response, if any trigger exists
    trigger   the triggers only (shown to still collapse; kept for ablations)
The harmful tokens are those after the trigger: their prefix has vanishing probability under the current policy
while their own ratios look normal, so pushing them down keeps dragging the policy.

Vetoed tokens leave the numerator and, with renorm_dropped=deferred (the default here), the denominator too:
finish_accumulation's grad_scale = sum(w) / sum(w * keep) over the whole step (all micro-batches and ranks),
i.e. the loss becomes the w-weighted mean over unvetoed tokens. For token-mean that is exactly
sum(m' * l) / sum(m'), with m' the vetoed mask; it does not depend on how the batch is split.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from mcore_rl.algorithms.base import PolicyTerms, TokenBatch
from mcore_rl.algorithms.correction import check_choice
from mcore_rl.algorithms.grpo import GRPO, GrpoConfig
from mcore_rl.algorithms.ops import masked_mean
from mcore_rl.algorithms.reduce import Reducer
from mcore_rl.algorithms.registry import register_algorithm


def _after_first(trig: Tensor) -> Tensor:
    return (trig.cumsum(dim=1) - trig.long()) > 0


_SCOPES: dict[str, Callable[[Tensor], Tensor]] = {
    "S_kappa": _after_first,
    "H_kappa": lambda trig: _after_first(trig) & ~trig,
    "seq": lambda trig: trig.any(dim=1, keepdim=True).expand_as(trig),
    "trigger": lambda trig: trig,
}
NAV_SCOPES: tuple[str, ...] = tuple(_SCOPES) + ("none",)
# Every scope vetoes tokens only in responses that hold a trigger (rho < nav_delta on an A < 0 token), so a run
# without triggers computes the same loss under every scope and with the veto off. The probes say how close the policy
# came: the share of A < 0 tokens whose ratio fell below each value, logged as nav_rho_below_<p> per step.
RHO_PROBES = (0.5, 0.1, 0.01)


@torch.no_grad()
def nav_veto(log_rho: Tensor, adv: Tensor, mask: Tensor, delta: float, scope: str) -> tuple[Tensor, Tensor]:
    """(vetoed [B, T] bool, triggers [B, T] bool) for the given scope; only rows with A < 0 are touched."""
    check_choice("mu_grpo", "nav_scope", scope, NAV_SCOPES)
    valid = (mask > 0) & (adv < 0)
    trig = valid & (log_rho < math.log(delta))
    if scope == "none":
        return torch.zeros_like(trig), trig
    return _SCOPES[scope](trig) & valid, trig


@dataclass
class MuGrpoConfig(GrpoConfig):
    name: str = "mu_grpo"
    schedule: str = "staged"
    updates_per_stage: int = 1024      # mu
    old_logp_source: str = "rollout"   # ratios against the stored behaviour log-probs
    eps_low: float = 1.0               # relaxed clip [0, 5]
    eps_high: float = 4.0
    kl_coef: float = 0.0
    loss_agg_mode: str = "token-mean"
    nav_scope: str = "S_kappa"         # S_kappa | H_kappa | seq | trigger | none
    nav_delta: float = 1e-4            # trigger threshold on rho (placeholder: unknown in the paper)
    renorm_dropped: str = "deferred"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice(f"algorithm {self.name!r}", "nav_scope", self.nav_scope, NAV_SCOPES)
        if not 0 < self.nav_delta < 1:
            raise ValueError(f"algorithm {self.name!r}: nav_delta must be in (0, 1), got {self.nav_delta}")


@register_algorithm("mu_grpo")
class MuGRPO(GRPO):
    config_cls = MuGrpoConfig
    config: MuGrpoConfig
    sum_keys = ("nav_vetoed", "nav_triggers", "neg_tokens", "neg_ratio_sum",
                *(f"nav_rho_below_{p:g}" for p in RHO_PROBES))
    skips_inert_rows = False  # its veto scopes read whole-sequence / whole-batch ratios, inert rows included

    def policy_terms(self, batch: TokenBatch, reduce: Reducer) -> PolicyTerms:
        c, m = self.config, batch.mask
        loss, log_r, metrics = self.clip_terms(batch, self.anchor_logp(batch))
        vetoed, trig = nav_veto(log_r.detach(), batch.advantages, m, c.nav_delta, c.nav_scope)
        f = log_r.dtype
        neg = (m > 0) & (batch.advantages < 0)
        rho = torch.exp(log_r.detach())
        metrics.update({
            "nav_vetoed_frac": masked_mean(vetoed.to(f), m),
            "nav_trigger_frac": masked_mean(trig.to(f), m),
            "nav_vetoed_seqs": vetoed.any(dim=1).sum().to(f),
            "ratio_mean_neg_adv": masked_mean(rho, neg),
        })
        sums = {"nav_vetoed": vetoed.sum(), "nav_triggers": trig.sum(), "neg_tokens": neg.sum(),
                "neg_ratio_sum": (rho * neg).sum(),
                **{f"nav_rho_below_{p:g}": (neg & (rho < p)).sum() for p in RHO_PROBES}}
        return PolicyTerms(pg=loss, keep=(~vetoed).to(f), metrics=metrics, sums=sums)

    def step_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        tok, neg = max(sums["tok_total"], 1.0), max(sums["neg_tokens"], 1.0)
        return {"nav_vetoed_frac": sums["nav_vetoed"] / tok,
                "nav_trigger_frac": sums["nav_triggers"] / tok,
                "ratio_mean_neg_adv": sums["neg_ratio_sum"] / neg,
                **{f"nav_rho_below_{p:g}": sums[f"nav_rho_below_{p:g}"] / neg for p in RHO_PROBES}}
