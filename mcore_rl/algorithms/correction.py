"""Rollout-vs-trainer mismatch correction (TIS / MIS / RS / veto), usable by every algorithm via its config.

The rollout engine samples with pi_roll (different kernels, precision, maybe stale weights); the trainer's
pi_train differs a little. A detached importance weight w = pi_train / pi_roll re-weights or masks the
policy-gradient term of each token:
- tis:  weight = clamp(w, tis_min, tis_max)                 (truncated IS; keeps every token)
- mis:  weight = w, token kept only if low <= w <= high     (masked IS, IcePop)
- rs:   weight = 1, token kept only if low <= w <= high     (rejection sampling)
- veto: a whole sequence is masked if any token ratio < veto_threshold (catastrophic tokens), any mode.
w is taken at `level`: token (per token), sequence (product over the response, exp(sum log w)) or geometric
(exp(mean log w)), broadcast over the response. `ratio` picks pi_train: "old" = trainer recompute at the
behaviour weights (decoupled PPO; needs old_logp), "current" = current logp, detached (bypass / REINFORCE).
Masked tokens are removed from the loss numerator; whether they also leave the denominator is the
algorithm's `renorm_dropped` setting (see base.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mcore_rl.algorithms.ops import LOG_RATIO_CLAMP, log_ratio, masked_max, masked_mean, masked_min


def check_choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{owner}: {name}={value!r} is not one of {list(choices)}")


def _level_token(lw: Tensor, m: Tensor) -> Tensor:
    return lw


def _level_sequence(lw: Tensor, m: Tensor) -> Tensor:
    return lw.sum(dim=1, keepdim=True).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).expand_as(lw)


def _level_geometric(lw: Tensor, m: Tensor) -> Tensor:
    n = m.sum(dim=1, keepdim=True).clamp(min=1)
    return (lw.sum(dim=1, keepdim=True) / n).expand_as(lw)


_LEVELS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "token": _level_token, "sequence": _level_sequence, "geometric": _level_geometric}
LEVELS: tuple[str, ...] = tuple(_LEVELS)


def level_log_ratio(token_log_ratio: Tensor, mask: Tensor, level: str) -> Tensor:
    """Log importance ratio at `level`, broadcast to [B, T]; zero on padding (ratio 1)."""
    check_choice("correction", "level", level, LEVELS)
    m = (mask > 0).to(token_log_ratio.dtype)
    lw = _LEVELS[level](token_log_ratio * m, m)
    return lw * m


@dataclass
class CorrectionConfig:
    mode: str = "none"                 # none | tis | mis | rs
    level: str = "token"               # token | sequence | geometric
    ratio: str = "old"                 # old: pi_old/pi_roll (needs old_logp) | current: pi_theta/pi_roll (detached)
    tis_max: float = 2.0               # TIS upper truncation C (verl rollout_is_threshold, slime --tis-clip)
    tis_min: float = 0.0               # TIS lower truncation (slime --tis-clip-low)
    low: float = 0.5                   # MIS/RS keep interval [low, high]
    high: float = 2.0
    veto_threshold: float | None = None  # e.g. 1e-4: mask a sequence with any token ratio below it

    def __post_init__(self) -> None:
        check_choice("correction", "mode", self.mode, CORRECTION_MODES)
        check_choice("correction", "level", self.level, LEVELS)
        check_choice("correction", "ratio", self.ratio, RATIO_SOURCES)
        if not 0 <= self.tis_min < self.tis_max:
            raise ValueError(f"correction: need 0 <= tis_min < tis_max, got {self.tis_min}, {self.tis_max}")
        if not 0 <= self.low < self.high:
            raise ValueError(f"correction: need 0 <= low < high, got low={self.low}, high={self.high}")
        if self.veto_threshold is not None and not self.veto_threshold > 0:
            raise ValueError(f"correction: veto_threshold must be > 0 or null, got {self.veto_threshold}")

    @property
    def enabled(self) -> bool:
        return self.mode != "none" or self.veto_threshold is not None


def _none(w: Tensor, cfg: CorrectionConfig) -> tuple[Tensor, Tensor]:
    return torch.ones_like(w), torch.ones_like(w, dtype=torch.bool)


def _tis(w: Tensor, cfg: CorrectionConfig) -> tuple[Tensor, Tensor]:
    return w.clamp(cfg.tis_min, cfg.tis_max), torch.ones_like(w, dtype=torch.bool)


def _mis(w: Tensor, cfg: CorrectionConfig) -> tuple[Tensor, Tensor]:
    return w, (w >= cfg.low) & (w <= cfg.high)


def _rs(w: Tensor, cfg: CorrectionConfig) -> tuple[Tensor, Tensor]:
    return torch.ones_like(w), (w >= cfg.low) & (w <= cfg.high)


_MODES: dict[str, Callable[[Tensor, CorrectionConfig], tuple[Tensor, Tensor]]] = {
    "none": _none, "tis": _tis, "mis": _mis, "rs": _rs}
CORRECTION_MODES: tuple[str, ...] = tuple(_MODES)
RATIO_SOURCES: tuple[str, ...] = ("old", "current")


@dataclass
class CorrectionResult:
    weight: Tensor        # [B, T] detached multiplier of the policy-gradient term
    keep: Tensor          # [B, T] float, 0 = token masked by MIS/RS/veto
    metrics: dict[str, Tensor] = field(default_factory=dict)


@torch.no_grad()
def correction_weights(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor,
                       cfg: CorrectionConfig) -> CorrectionResult:
    """Detached correction weights and keep mask for one micro-batch, plus IS diagnostics."""
    m = mask > 0
    lw_tok = log_ratio(train_logp.detach(), rollout_logp, mask)
    w = torch.exp(level_log_ratio(lw_tok, mask, cfg.level))
    weight, keep = _MODES[cfg.mode](w, cfg)
    if cfg.veto_threshold is not None:
        bad = ((lw_tok < math.log(cfg.veto_threshold)) & m).any(dim=1, keepdim=True)
        keep = keep & ~bad
    keep = keep & m
    valid = m.sum().clamp(min=1)
    w_mean = masked_mean(w, m)
    metrics: dict[str, Tensor] = {
        "rollout_is_mean": w_mean,
        "rollout_is_max": masked_max(w, m),
        "rollout_is_min": masked_min(w, m),
        "rollout_is_std": masked_mean((w - w_mean) ** 2, m).sqrt(),
        "rollout_is_eff_sample_size": 1.0 / masked_mean((w / w_mean.clamp(min=1e-30)) ** 2, m).clamp(min=1e-30),
        "rollout_rs_masked_fraction": 1.0 - keep.sum() / valid,
    }
    if cfg.mode == "tis":
        metrics["tis_clipfrac"] = masked_mean(((w > cfg.tis_max) | (w < cfg.tis_min)).to(w.dtype), m)
    return CorrectionResult(weight.to(train_logp.dtype), keep.to(train_logp.dtype), metrics)


@torch.no_grad()
def mismatch_metrics(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Training-vs-rollout diagnostics, logged whether or not a correction is applied."""
    m = mask > 0
    mf = m.to(train_logp.dtype)
    lr = log_ratio(train_logp.detach(), rollout_logp, mask)        # log pi_train - log pi_roll
    r = torch.exp(lr)
    lens = mf.sum(dim=1)
    seq = lens > 0
    log_ppl_diff = ((-lr * mf).sum(dim=1)[seq] / lens[seq]).mean() if seq.any() else lr.new_zeros(())
    return {
        "train_rollout_logprob_abs_diff": masked_mean(lr.abs(), m),
        "rollout_kl": masked_mean(-lr, m),                         # k1 of KL(pi_roll || pi_train)
        "rollout_k3_kl": masked_mean(r - 1.0 - lr, m),              # k3 of KL(pi_roll || pi_train)
        "rollout_chi2_token": masked_mean(r * r, m) - 1.0,
        "log_ppl_diff": log_ppl_diff,                               # log ppl_train - log ppl_rollout
    }
