"""PPO-EWMA with decoupled train-infer correction (the revised PPO-EWMA of arXiv 2605.12070).

The ratio pi_theta / pi_infer splits at the token's behaviour version v into
    d_t = pi_a / pi_infer    training-inference discrepancy  -> Train-Infer Mask  1[lo <= log d <= hi]
    s_t = pi_theta / pi_a    policy staleness                -> PPO clip [1 - eps_low, 1 + eps_high]
    l_t = -M_t * min(s_t * A, clip(s_t) * A)    (optionally times min(d_t, ti_tis_max))
with the anchor pi_a picked by `old_logp_source` (two routes):
- exact (snapshot | old_logit_model | interrupt): pi_a = pi_old, the trainer at version v. d compares like
  with like (same weights, engine vs trainer), so the tight TI bounds hold at any staleness; s carries all
  of it. No EWMA weights exist (needs_prox_logp is False), so EWMA keys set with these sources are refused.
- ewma (rollout: pi_old missing): pi_a = pi_prox = pi_theta_bar.
  log d = log(pi_prox / pi_v) + log(pi_v / pi_infer) = drift + TI. theta_bar has mean age a steps (ewma.py)
  and a token lags at most L steps (lag_steps), so |theta_bar - v| <= a + L steps; PPO's clip bounds one
  step's move by log(1 + eps_high) up, log(1 - eps_low) down. The gate is the TI bounds widened by (a + L)
  of those: it only drops what staleness cannot explain. Tight TI gating needs exact old logits.
- The TI bounds (ti_bounds=auto, the default): the gate exists for tokens whose engine/trainer disagreement is
  abnormal, not for the dtype's noise floor (bf16 against an engine with other kernels: geometric |log d| ~0.01,
  heavy-tailed, far outside the paper's fixed [0.995, 1.005], which then drops most of the batch). Where d
  compares engine and trainer at equal versions -- the exact route always; the ewma route when its gap a + L is
  0 -- begin_update measures the update's q = ti_auto_quantile quantile of |log d| over every token of every DP
  rank (a histogram, reduce.global_abs_quantiles) and widens the bounds to +-w, w = min(ti_auto_k * q-quantile,
  ti_auto_max), never tighter than [ti_low, ti_high]. So the gate keeps at least a share q of the tokens unless
  the cap holds, and drops the tail beyond k times the noise's own spread; abnormal tokens move the quantile only
  when they are more than 1 - q of the batch (a whole-batch fault: the cap, and the warning). A quantile, not the
  median: most tokens of a confident policy agree almost exactly, so the median says little about the spread of
  the rest (measured: q90 / median up to 13). Elsewhere (ewma route, gap > 0) d mixes drift and TI: the fixed
  bounds, widened. ti_bounds=fixed: always [ti_low, ti_high] (the paper's).
- Reset (theta_bar <- theta, ewma route only): it sets a = 0 but replaces drift(theta_bar, v) by
  drift(theta, v), L steps: it helps the gate only when theta is closer to v than theta_bar is (measured: the
  keep-rate under theta, gate widened by L only, beats the step's), never under async with a < L. What a reset
  always does is set s = 1: it revives an anchor so far behind theta that the clip starves the gradient. So it
  fires on clip fraction >= reset_clip_frac, or on keep-rate < reset_keep_rate when theta would keep more.

`recompute` (like any inexact source but the engine's own log-probs) is refused: its log-probs (trainer forward at
the current weights, the wrong version for stale tokens) would enter neither route -- the exact route needs pi_old,
the ewma route reads pi_prox and pi_infer.

objective=original is Hilton et al.'s PPO-EWMA: -(pi_a / pi_behav) * min(s A, clip(s) A), with the behaviour
log-prob floored at logp_theta - log(imp_samp_max) so the weight is at most imp_samp_max.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from mcore_rl.algorithms.base import (
    Algorithm,
    AlgorithmConfig,
    PolicyTerms,
    StepDecision,
    TokenBatch,
)
from mcore_rl.algorithms.correction import LEVELS, check_choice, level_log_ratio
from mcore_rl.algorithms.ewma import ewma_step
from mcore_rl.algorithms.grpo import ppo_clip_loss
from mcore_rl.algorithms.ops import log_ratio, masked_mean
from mcore_rl.algorithms.reduce import Reducer, global_abs_quantiles, identity_reduce
from mcore_rl.algorithms.registry import register_algorithm
from mcore_rl.oldlogp.registry import is_exact

log = logging.getLogger(__name__)
OBJECTIVES = ("decoupled", "original")
TI_BOUNDS = ("auto", "fixed")
# exact route: a keep-rate under this after an update is reported once (the gate, not staleness, is eating the batch)
LOW_KEEP_RATE = 0.5
# exact route: the share of tokens with |log d| (at ti_level) within each of these, logged as ti_within_<t>: the
# engine-trainer noise floor, from which the warning suggests the tightest of these bounds keeping SUGGEST_KEEP
NOISE_PROBES = (0.005, 0.01, 0.02, 0.05, 0.1)
SUGGEST_KEEP = 0.9
# ewma-route keys: null = this default; set with an exact source they are refused (no EWMA exists)
EWMA_DEFAULTS = {"ewma_beta": 0.75, "auto_reset": True, "reset_keep_rate": 0.5, "reset_clip_frac": 0.5}


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


class TiCalibration(NamedTuple):
    """One update's engine/trainer disagreement measured at equal versions (begin_update), and the gate it sets."""

    median: float            # median |log d| over the update's tokens, all DP ranks (per token at sequence level)
    quantile: float          # its ti_auto_quantile quantile
    w: float | None          # auto: the calibrated half-width min(ti_auto_k * quantile, ti_auto_max); fixed: None


@dataclass
class PpoEwmaConfig(AlgorithmConfig):
    name: str = "ppo_ewma"
    schedule: str = "sync"             # the loss is the same sync or async (max_staleness applies to async)
    updates_per_rollout: int = 4
    max_staleness: int = 2
    old_logp_source: str = "rollout"   # rollout: EWMA proximal anchor | snapshot|old_logit_model|
    #                                    interrupt: exact pi_old anchor, no EWMA
    loss_agg_mode: str = "token-mean"
    objective: str = "decoupled"       # decoupled | original
    eps_low: float = 0.2               # staleness clip of s = pi_theta / pi_anchor
    eps_high: float = 0.2
    dual_clip_c: float | None = None
    ti_level: str = "geometric"        # token | sequence | geometric
    ti_low: float = 0.995              # Train-Infer Mask keeps low <= d <= high (at the same version; the
    ti_high: float = 1.005             # ewma route widens it by the staleness the clip allows)
    ti_bounds: str = "auto"            # auto: widened per update to +-min(ti_auto_k * quantile, ti_auto_max) where
    #                                    d is measured at equal versions (never tighter than ti_low/ti_high) |
    #                                    fixed: ti_low/ti_high always (the paper's)
    ti_auto_quantile: float = 0.9      # auto: which quantile of the measured |log d| scales the half-width; the
    #                                    gate keeps at least this share of the tokens unless the cap holds
    ti_auto_k: float = 3.0             # auto: the half-width in those quantiles (>= 1)
    ti_auto_max: float = 0.2           # auto: cap on the half-width; beyond it engine and trainer disagree beyond
    #                                    rounding (a dtype or weight-sync fault), and the gate says so
    ti_tis_max: float | None = None    # optional: also multiply by min(d, ti_tis_max)
    imp_samp_max: float = 100.0        # objective=original: cap of pi_anchor / pi_behav
    # --- ewma route only (null = EWMA_DEFAULTS) ---
    ewma_beta: float | None = None     # studied: 0.4, 0.5, 0.75
    auto_reset: bool | None = None
    reset_keep_rate: float | None = None  # reset when the keep-rate is below this AND theta would keep more
    reset_clip_frac: float | None = None  # reset when this fraction of tokens is clipped (starved step)

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = f"algorithm {self.name!r}"
        check_choice(owner, "objective", self.objective, OBJECTIVES)
        check_choice(owner, "ti_level", self.ti_level, LEVELS)
        check_choice(owner, "ti_bounds", self.ti_bounds, TI_BOUNDS)
        if not 0 < self.ti_auto_quantile < 1:
            raise ValueError(f"{owner}: ti_auto_quantile must be in (0, 1), got {self.ti_auto_quantile}")
        if not 1 <= self.ti_auto_k < math.inf:
            raise ValueError(f"{owner}: ti_auto_k must be finite and >= 1 (the gate then keeps the tokens within the "
                             f"quantile), got {self.ti_auto_k}")
        if not 0 < self.ti_auto_max < math.inf:
            raise ValueError(f"{owner}: ti_auto_max must be finite and > 0, got {self.ti_auto_max}")
        if not is_exact(self.old_logp_source) and self.old_logp_source != "rollout":  # recompute, or any inexact one
            raise ValueError(f"{owner}: old_logp_source={self.old_logp_source} computes log-probs its loss never "
                             "reads (the EWMA route anchors on pi_prox and the engine's log-probs); use rollout "
                             "(EWMA anchor) or snapshot|old_logit_model|interrupt (exact pi_old)")
        if is_exact(self.old_logp_source):
            given = [k for k in EWMA_DEFAULTS if getattr(self, k) is not None]
            if given:
                raise ValueError(f"{owner}: {', '.join(given)} set with "
                                 f"old_logp_source={self.old_logp_source}, whose exact old logits replace "
                                 "the EWMA proximal policy (none is kept); unset it or use "
                                 "old_logp_source=rollout")
        else:
            for k, v in EWMA_DEFAULTS.items():
                if getattr(self, k) is None:
                    setattr(self, k, v)
            if not 0.0 <= self.ewma_beta < 1.0:
                raise ValueError(f"{owner}: ewma_beta must be in [0, 1), got {self.ewma_beta}")
            for k in ("reset_keep_rate", "reset_clip_frac"):
                if not 0 <= getattr(self, k) <= 1:
                    raise ValueError(f"{owner}: {k} must be in [0, 1], got {getattr(self, k)}")
        if not 0 <= self.eps_low <= 1 or self.eps_high < 0:
            raise ValueError(f"{owner}: need 0 <= eps_low <= 1 and eps_high >= 0, got {self.eps_low}, "
                             f"{self.eps_high}")
        if not 0 <= self.ti_low <= 1 <= self.ti_high:
            raise ValueError(f"{owner}: need 0 <= ti_low <= 1 <= ti_high, got {self.ti_low}, {self.ti_high}")
        if self.imp_samp_max <= 1:
            raise ValueError(f"{owner}: imp_samp_max must be > 1, got {self.imp_samp_max}")

    @property
    def exact(self) -> bool:
        return is_exact(self.old_logp_source)

    @property
    def lag_steps(self) -> int:
        """Most optimizer steps a consumed token's version can trail the live weights."""
        per_round = self.updates_per_stage if self.schedule == "staged" else self.updates_per_rollout
        rounds = self.max_staleness + 1 if self.schedule == "async" else 1
        return rounds * per_round - 1


@register_algorithm("ppo_ewma")
class PPOEWMA(Algorithm):
    config_cls = PpoEwmaConfig
    config: PpoEwmaConfig
    sum_keys = ("ti_kept", "ti_kept_theta", "clip_tok", *(f"ti_within_{t:g}" for t in NOISE_PROBES))

    def __init__(self, config: PpoEwmaConfig) -> None:
        super().__init__(config)
        self.last_keep_rate: float | None = None
        self.num_resets = 0
        self.ewma_weight, self.ewma_age = 1.0, 0.0   # mirrors EwmaWeights (the trainer holds the weights)
        self._warned_low_keep = False

    @property
    def needs_prox_logp(self) -> bool:
        return not self.config.exact

    def reset_accumulation(self) -> None:
        super().reset_accumulation()
        self._calibration: TiCalibration | None = None  # set by begin_update, read until finish_accumulation

    def gap_steps(self) -> float:
        """Steps the gate's anchor may lie from the tokens' behaviour version: 0 on the exact route, a + L on the
        ewma route (0 there only on policy with a fresh EWMA: then d too is measured at equal versions)."""
        c = self.config
        return 0.0 if c.exact else self.ewma_age + c.lag_steps

    def begin_update(self, old_logp: Tensor | None, prox_logp: Tensor | None, rollout_logp: Tensor, mask: Tensor,
                     reduce: Reducer = identity_reduce) -> dict[str, float]:
        """This update's TI bounds, from its whole batch before the first micro-batch (the same gate for every
        micro-batch and DP rank). Only where d = pi_anchor / pi_infer compares engine and trainer at equal
        versions (gap 0) is its spread the noise floor the gate must tolerate; elsewhere nothing is measured and
        the gate keeps the fixed bounds. Without this call (no anchor, or a caller that skips the hook) likewise.
        ti_bounds=fixed measures too (the noise metrics are logged) but gates with [ti_low, ti_high]. At
        ti_level=sequence log d is a sum over the response: measured per token (the geometric mean) and scaled
        back by the row's length in the gate, as the staleness widening is."""
        c = self.config
        anchor = old_logp if c.exact else prox_logp
        if anchor is None or self.gap_steps() > 0:
            return {}
        level = "geometric" if c.ti_level == "sequence" else c.ti_level
        log_d = level_log_ratio(log_ratio(anchor, rollout_logp, mask), mask, level)
        median, q = global_abs_quantiles(log_d, mask, (0.5, c.ti_auto_quantile), reduce)
        w = min(c.ti_auto_k * q, c.ti_auto_max) if c.ti_bounds == "auto" else None
        self._calibration = TiCalibration(median, q, w)
        return {}

    def gate(self, token_log_ratio: Tensor, m: Tensor, gap_steps: float) -> Tensor:
        """Train-Infer Mask at ti_level: the TI bounds, at least this update's calibrated half-width (if any), plus
        `gap_steps` steps of clip-bounded drift. Per-token widths scale by the row's length at sequence level,
        whose log d sums per-token terms."""
        c = self.config
        log_d = level_log_ratio(token_log_ratio, m, c.ti_level)
        scale = m.sum(dim=1, keepdim=True) if c.ti_level == "sequence" else torch.ones_like(m[:, :1])
        lo, hi = _log(c.ti_low), _log(c.ti_high)
        w = None if self._calibration is None else self._calibration.w
        if w is not None:
            lo, hi = (-w * scale).clamp(max=lo), (w * scale).clamp(min=hi)
        if gap_steps > 0:
            lo = lo + gap_steps * _log(1.0 - c.eps_low) * scale
            hi = hi + gap_steps * math.log1p(c.eps_high) * scale
        return (log_d >= lo) & (log_d <= hi) & (m > 0)

    def policy_terms(self, batch: TokenBatch, reduce: Reducer) -> PolicyTerms:
        c, m = self.config, batch.mask
        anchor, infer = (batch.old_logp if c.exact else batch.prox_logp), batch.rollout_logp
        log_s = log_ratio(batch.logp, anchor, m)
        loss, clip_active, dual_active = ppo_clip_loss(log_s, batch.advantages, c.eps_low, c.eps_high,
                                                       c.dual_clip_c)
        f = log_s.dtype
        sums: dict[str, Tensor] = {"clip_tok": (clip_active & (m > 0)).sum()}
        with torch.no_grad():
            tok_d = log_ratio(anchor, infer, m)
            log_d = level_log_ratio(tok_d, m, c.ti_level)
            d = torch.exp(log_d)
            ti_keep = self.gate(tok_d, m, self.gap_steps())
            if c.exact:  # the noise floor: what the gate would keep at other bounds
                sums.update({f"ti_within_{t:g}": ((log_d.abs() <= t) & (m > 0)).sum() for t in NOISE_PROBES})
            else:  # what a reset would give: theta as the anchor, only the tokens' lag to tolerate
                theta_d = log_ratio(batch.logp.detach(), infer, m)
                sums["ti_kept_theta"] = self.gate(theta_d, m, float(c.lag_steps)).sum()
        metrics = {
            "pg_clipfrac": masked_mean(clip_active.to(f), m),
            "pg_clipfrac_lower": masked_mean(dual_active.to(f), m),
            "ppo_kl": masked_mean(-log_s.detach(), m),
            "ti_keep_rate": masked_mean(ti_keep.to(f), m),
            "ti_ratio_mean": masked_mean(d, m),
        }
        sums["ti_kept"] = ti_keep.sum()
        if c.objective == "original":
            log_behav = torch.maximum(infer, batch.logp.detach() - math.log(c.imp_samp_max))
            weight = torch.exp(log_ratio(anchor, log_behav, m)).detach()
            return PolicyTerms(pg=weight * loss, metrics=metrics, sums=sums)
        if c.ti_tis_max is not None:
            loss = loss * d.clamp(max=c.ti_tis_max)
        return PolicyTerms(pg=loss, keep=ti_keep.to(f), metrics=metrics, sums=sums)

    def step_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        n = sums["tok_total"]
        self.last_keep_rate = sums["ti_kept"] / n if n else 1.0
        out = {"ti_keep_rate": self.last_keep_rate, "step_clipfrac": sums["clip_tok"] / n if n else 0.0}
        if self.config.exact:
            out.update({f"ti_within_{t:g}": sums[f"ti_within_{t:g}"] / n if n else 1.0 for t in NOISE_PROBES})
        else:
            out["ti_keep_rate_theta"] = sums["ti_kept_theta"] / n if n else 1.0
        cal = self._calibration
        if cal is not None:  # measured at equal versions: the noise floor, and the half-width it set
            out.update(ti_noise_median=cal.median, ti_noise_quantile=cal.quantile)
            if cal.w is not None:
                out["ti_bound"] = cal.w
        return out

    def state_dict(self) -> dict[str, float | int | None]:
        return {"num_resets": self.num_resets, "last_keep_rate": self.last_keep_rate,
                "ewma_weight": self.ewma_weight, "ewma_age": self.ewma_age}

    def after_optimizer_step(self, metrics: dict[str, float]) -> StepDecision:
        """Ask for an EWMA reset when it helps (module docstring), and follow the EWMA's age."""
        c = self.config
        rate = metrics.get("ti_keep_rate", self.last_keep_rate)
        if c.exact:
            self._warn_low_keep(rate, metrics)
            return StepDecision()
        starved = metrics.get("step_clipfrac", 0.0) >= c.reset_clip_frac
        theta_rate = metrics.get("ti_keep_rate_theta", 0.0)
        helps = rate is not None and rate < c.reset_keep_rate and theta_rate > rate
        reset = bool(c.auto_reset and (starved or helps))
        self.num_resets += int(reset)
        beta = 0.0 if reset else c.ewma_beta
        self.ewma_weight, self.ewma_age = ewma_step(self.ewma_weight, self.ewma_age, beta)
        return StepDecision(reset_ewma=reset, metrics={"ewma_reset": float(reset), "ewma_age": self.ewma_age,
                                                       "ewma_resets_total": float(self.num_resets)})

    def _warn_low_keep(self, rate: float | None, metrics: dict[str, float]) -> None:
        """On the exact route d compares engine and trainer at the same weights, so a low keep-rate is their
        numerical disagreement, not staleness. Said once. Fixed bounds: in bf16 (per-token |log d| ~0.03 on CPU)
        the paper's gate on ~20-token answers keeps about a third of the sequences; the warning gives the keep-rate
        this update's tokens would have had at wider bounds and the tightest of those that keeps SUGGEST_KEEP of
        them. Auto bounds keep at least ti_auto_quantile of the tokens unless capped, so a low keep-rate there
        means the cap held: engine and trainer disagree beyond rounding."""
        c = self.config
        if rate is None or rate >= LOW_KEEP_RATE or self._warned_low_keep:
            return
        self._warned_low_keep = True
        within = {t: metrics[f"ti_within_{t:g}"] for t in NOISE_PROBES if f"ti_within_{t:g}" in metrics}
        floor = ", ".join(f"{t:g}: {v:.2f}" for t, v in within.items())
        fit = [t for t, v in within.items() if v >= SUGGEST_KEEP]
        beyond = "engine and trainer disagree beyond rounding (check model.dtype and the weight sync)"
        if "ti_bound" in metrics:
            gate = (f"auto gate |log d| <= {metrics['ti_bound']:.3g}: ti_auto_k={c.ti_auto_k:g} x the "
                    f"{c.ti_auto_quantile:g} quantile {metrics['ti_noise_quantile']:.3g}, at most "
                    f"ti_auto_max={c.ti_auto_max:g}")
            advice = (f"the cap held: {beyond}; raise algorithm.ti_auto_max only where a disagreement this large is "
                      "expected" if metrics["ti_bound"] >= c.ti_auto_max else "a quantile under 0.5 keeps this "
                      "little by design (raise algorithm.ti_auto_quantile)")
        else:
            gate = f"gate [{c.ti_low:g}, {c.ti_high:g}]"
            advice = (f"algorithm.ti_low={math.exp(-fit[0]):.4g} algorithm.ti_high={math.exp(fit[0]):.4g} would have "
                      f"kept {within[fit[0]]:.2f} (algorithm.ti_bounds=auto calibrates the bounds per update)" if fit
                      else f"no bound up to |log d| {NOISE_PROBES[-1]:g} keeps {SUGGEST_KEEP:g} of them: {beyond}")
        log.warning(
            "ppo_ewma: the Train-Infer Mask kept %.2f of the tokens this update (exact old logits: engine vs "
            "trainer at the same weights, %s at ti_level=%s); the rest train nothing. Share of tokens "
            "with |log d| within {%s}; %s (docs/algorithms.md)",
            rate, gate, c.ti_level, floor, advice,
        )  # fmt: skip
