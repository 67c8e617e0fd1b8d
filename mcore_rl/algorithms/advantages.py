"""Sequence-level advantages from outcome rewards, grouped by prompt.

A_i = R_i - mean_G(R), then divided by a spread chosen by `std_norm`:
- "group": std of the prompt's group (GRPO, DAPO). Unbiased std by default, eps = 1e-6 (verl's convention).
- "none":  no division (Dr.GRPO): scaling rewards by k scales A by k, which is the point of Dr.GRPO.
- "batch": one std over the whole global batch (ScaleRL); it is either the std of the centred advantages or of
  the raw rewards (`batch_std_source`), computed over the sequences that survive zero-variance filtering.
A group of size one gets mean 0 and std 1 (verl), i.e. A = R, unless it is filtered.

`leave_one_out_advantages` (RLOO) takes the mean over the group's *other* responses as the baseline instead; a group
of size one has none and is refused (`refuse_singleton_groups`), as is REINFORCE++-baseline's.

Zero-variance filtering: a group whose rewards are all equal (size-one groups included) carries no
group-relative signal; with `filter_zero_variance` its sequences get keep=False and A=0. The trainer drops them
from the loss batch (or zeroes their mask) before computing aggregation weights, so they change no denominator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mcore_rl.algorithms.aggregation import group_inverse
from mcore_rl.algorithms.reduce import Reducer, identity_reduce, stack_sums


@dataclass
class AdvantageResult:
    """Per-sequence advantages plus the zero-variance keep mask (the trainer broadcasts A over tokens)."""

    advantages: Tensor          # [N] float32 (0 for filtered sequences)
    keep: Tensor                # [N] bool: False = drop this sequence from the loss batch
    num_groups: int             # local prompt groups
    num_zero_variance_groups: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class _GroupStats:
    inv: Tensor        # [N] group index
    mean: Tensor       # [N] group mean broadcast to sequences (float64)
    std: Tensor        # [N] group std broadcast to sequences
    zero_var: Tensor   # [N] bool: the sequence's group has all-equal rewards (or size one)
    num_groups: int
    num_zero_var: int


def group_stats(rewards: Tensor, group_ids: Tensor, unbiased: bool = True) -> _GroupStats:
    r = rewards.detach().to(torch.float64)
    inv, g = group_inverse(group_ids)
    dev = r.device
    count = torch.zeros(g, dtype=torch.float64, device=dev).index_add_(0, inv, torch.ones_like(r))
    mean = torch.zeros(g, dtype=torch.float64, device=dev).index_add_(0, inv, r) / count.clamp(min=1)
    sq = torch.zeros(g, dtype=torch.float64, device=dev).index_add_(0, inv, (r - mean[inv]) ** 2)
    denom = (count - 1).clamp(min=1) if unbiased else count.clamp(min=1)
    std = (sq / denom).sqrt()
    single = count <= 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    rmax = torch.full((g,), -torch.inf, dtype=torch.float64, device=dev).scatter_reduce(0, inv, r, "amax")
    rmin = torch.full((g,), torch.inf, dtype=torch.float64, device=dev).scatter_reduce(0, inv, r, "amin")
    zero_var = (rmax == rmin) | single
    return _GroupStats(inv, mean[inv], std[inv], zero_var[inv], g, int(zero_var.sum()))


def _norm_group(centred: Tensor, rewards: Tensor, st: _GroupStats, keep: Tensor, eps: float, unbiased: bool,
                source: str, reduce: Reducer) -> Tensor:
    return centred / (st.std + eps)


def _norm_none(centred: Tensor, rewards: Tensor, st: _GroupStats, keep: Tensor, eps: float, unbiased: bool,
               source: str, reduce: Reducer) -> Tensor:
    return centred


def _norm_batch(centred: Tensor, rewards: Tensor, st: _GroupStats, keep: Tensor, eps: float, unbiased: bool,
                source: str, reduce: Reducer) -> Tensor:
    x = (centred if source == "advantages" else rewards)[keep]
    n, s1, s2 = reduce(stack_sums(float(x.numel()), x.sum(), (x * x).sum(), device=centred.device)).tolist()
    if n < 2:
        return centred
    var = (s2 - s1 * s1 / n) / ((n - 1) if unbiased else n)
    return centred / (max(var, 0.0) ** 0.5 + eps)


_NORMS: dict[str, Callable[..., Tensor]] = {"group": _norm_group, "none": _norm_none, "batch": _norm_batch}
STD_NORMS: tuple[str, ...] = tuple(_NORMS)
BATCH_STD_SOURCES: tuple[str, ...] = ("advantages", "rewards")


def compute_advantages(rewards: Tensor, group_ids: Tensor, *, std_norm: str = "group", eps: float = 1e-6,
                       unbiased: bool = True, filter_zero_variance: bool = False,
                       batch_std_source: str = "advantages", reduce: Reducer = identity_reduce) -> AdvantageResult:
    """Group-relative advantages; only std_norm="batch" talks to other ranks (through `reduce`)."""
    if std_norm not in _NORMS:
        raise ValueError(f"adv_std_norm={std_norm!r} is not one of {list(STD_NORMS)}")
    if batch_std_source not in BATCH_STD_SOURCES:
        raise ValueError(f"batch_std_source={batch_std_source!r} is not one of {list(BATCH_STD_SOURCES)}")
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(f"rewards and group_ids must both be [N]; got {tuple(rewards.shape)}, {tuple(group_ids.shape)}")
    r = rewards.detach().to(torch.float64)
    st = group_stats(r, group_ids, unbiased)
    keep = ~st.zero_var if filter_zero_variance else torch.ones_like(st.zero_var)
    centred = r - st.mean
    adv = _NORMS[std_norm](centred, r, st, keep, eps, unbiased, batch_std_source, reduce)
    return advantage_result(r, adv, keep, st)


def advantage_result(rewards: Tensor, adv: Tensor, keep: Tensor, st: _GroupStats) -> AdvantageResult:
    """The result every estimator returns: A zeroed where filtered, and the metrics the run log shows per update."""
    adv = torch.where(keep, adv, torch.zeros_like(adv))
    n = max(rewards.numel(), 1)
    metrics = {
        "reward_mean": float(rewards.sum()) / n,
        "adv_mean": float(adv.sum()) / n,
        "adv_abs_mean": float(adv.abs().sum()) / n,
        "zero_variance_group_frac": st.num_zero_var / max(st.num_groups, 1),
        "kept_seq_frac": float(keep.sum()) / n,
    }
    return AdvantageResult(adv.to(torch.float32), keep, st.num_groups, st.num_zero_var, metrics)


def overlong_penalty(lengths: Tensor, max_len: int, buffer_len: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment, added to the reward.

    0 up to max_len - buffer_len, then a linear ramp down to -factor at max_len (and -factor beyond), so that
    truncated answers are discouraged smoothly instead of with a cliff.
    """
    if buffer_len <= 0 or buffer_len > max_len:
        raise ValueError(f"overlong_buffer_len={buffer_len} must be in (0, max_response_len={max_len}]")
    start = max_len - buffer_len
    pen = -(lengths.to(torch.float64) - start) / buffer_len * factor
    return pen.clamp(min=-factor, max=0.0)


def refuse_singleton_groups(group_ids: Tensor, owner: str) -> None:
    """A baseline built from a prompt's other responses does not exist for a group of one: refuse it in one line
    (a config error: the group size is trainer.samples_per_prompt) rather than train on A = R or A = 0."""
    # imported here: importing mcore_rl.config loads every group's schema, which the losses do not otherwise need
    from mcore_rl.config.checks import ConfigError

    if group_ids.numel() and int(torch.unique(group_ids, return_counts=True)[1].min()) < 2:
        raise ConfigError(f"{owner}: a prompt group of one response has no baseline from the other responses; "
                          "set trainer.samples_per_prompt >= 2")


def leave_one_out_advantages(rewards: Tensor, group_ids: Tensor, *, std_norm: str = "none", eps: float = 1e-6,
                             unbiased: bool = True, filter_zero_variance: bool = False,
                             reduce: Reducer = identity_reduce, owner: str = "rloo") -> AdvantageResult:
    """RLOO: A_i = R_i - mean_{j != i in G} R_j = G/(G-1) (R_i - mean_G R), every group of size G >= 2.

    The baseline leaves the response itself out, so it is independent of that response and the estimator is
    unbiased (Kool et al. 2019; Ahmadian et al. 2024). `std_norm="batch"` divides by one std of the advantages over
    the global batch (TRL's `normalize_advantages`; each group's advantages sum to 0, so their batch mean is 0 and
    TRL's centring changes nothing); "none" keeps the reward scale.
    """
    if std_norm not in ("none", "batch"):
        raise ValueError(f"{owner}: adv_std_norm={std_norm!r} is not one of ['none', 'batch']")
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(f"rewards and group_ids must both be [N]; got {tuple(rewards.shape)}, {tuple(group_ids.shape)}")
    refuse_singleton_groups(group_ids, f"algorithm {owner!r}")
    r = rewards.detach().to(torch.float64)
    st = group_stats(r, group_ids, unbiased)
    inv, g = group_inverse(group_ids)
    count = torch.zeros(g, dtype=torch.float64, device=r.device).index_add_(0, inv, torch.ones_like(r))[inv]
    adv = count / (count - 1) * (r - st.mean)
    keep = ~st.zero_var if filter_zero_variance else torch.ones_like(st.zero_var)
    if std_norm == "batch":
        adv = _norm_batch(adv, r, st, keep, eps, unbiased, "advantages", reduce)
    return advantage_result(r, adv, keep, st)
