"""Reducers: how the algorithms obtain statistics of the whole (data-parallel) batch.

Every global quantity (token counts for aggregation, P3O's ESS, ScaleRL's batch std, accumulated veto
masses, PPO-EWMA's train-inference disagreement quantiles as a histogram's counts) is a *sum* over ranks, so the
algorithms only ever need one primitive: a SUM all-reduce. Passing it in as a callable keeps the algorithm modules
free of torch.distributed and testable in one process.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from mcore_rl.algorithms.ops import LOG_RATIO_CLAMP

Reducer = Callable[[Tensor], Tensor]

# Thresholds of `global_abs_quantiles`' histogram: 0 (exact agreement), then log-spaced from 1e-6 to 20 (the
# log-ratio clamp) in steps of 1%: a quantile is read to one step, and a sum of counts is exact whatever the split.
QUANTILE_GRID = torch.cat([torch.zeros(1, dtype=torch.float64),
                           torch.logspace(-6.0, math.log10(LOG_RATIO_CLAMP), 1700, dtype=torch.float64)[:-1],
                           torch.tensor([LOG_RATIO_CLAMP], dtype=torch.float64)])


def identity_reduce(x: Tensor) -> Tensor:
    """The reducer of a single process: the local sum already is the global sum."""
    return x


def make_dist_reducer(group: object | None = None) -> Reducer:
    """SUM all-reduce over `group` (e.g. Megatron's data-parallel group); returns a fresh tensor on `x`'s device.

    The input is left untouched, so callers may pass views of tensors they still use. The device the group needs
    (CUDA for NCCL) is `mcore_rl.distributed`'s business, so the algorithms may keep their statistics on the CPU.
    """
    from mcore_rl.distributed import sum_reducer

    return sum_reducer(group)


def stack_sums(*values: Tensor | float, device: torch.device | None = None) -> Tensor:
    """Stack scalars into one float64 vector so several sums travel in a single all-reduce."""
    parts = [v.detach().reshape(()).to(torch.float64) if isinstance(v, Tensor) else torch.tensor(
        float(v), dtype=torch.float64) for v in values]
    if device is None:
        device = next((v.device for v in values if isinstance(v, Tensor)), torch.device("cpu"))
    return torch.stack([p.to(device) for p in parts])


def global_abs_quantiles(x: Tensor, mask: Tensor, qs: tuple[float, ...],
                         reduce: Reducer = identity_reduce) -> list[float]:
    """Quantiles `qs` of |x| over the entries with mask > 0 on every rank: for each q the smallest `QUANTILE_GRID`
    threshold that at least a share q of them lie within (0.0 where they are exactly 0, inf beyond the grid; all
    0.0 with no entries).

    Why a histogram: a quantile is not a sum, but the counts under fixed thresholds are, so one all-reduce gives the
    whole batch's counts exactly, and the result does not depend on how rows are split over ranks or micro-batches.
    """
    grid = QUANTILE_GRID.to(x.device)
    v = x.detach()[mask > 0].abs().to(torch.float64)
    counts = reduce(torch.bincount(torch.bucketize(v, grid), minlength=len(grid) + 1).to(torch.float64))
    n = float(counts.sum())
    if n == 0:
        return [0.0 for _ in qs]
    idx = torch.searchsorted(counts.cumsum(0), torch.tensor([q * n for q in qs], dtype=torch.float64,
                                                            device=counts.device)).tolist()
    return [float(grid[j]) if j < len(grid) else math.inf for j in idx]
