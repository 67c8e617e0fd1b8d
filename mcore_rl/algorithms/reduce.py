"""Reducers: how the algorithms obtain statistics of the whole (data-parallel) batch.

Every global quantity (token counts for aggregation, P3O's ESS, ScaleRL's batch std, accumulated veto
masses) is a *sum* over ranks, so the algorithms only ever need one primitive: a SUM all-reduce. Passing it
in as a callable keeps the algorithm modules free of torch.distributed and testable in one process.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

Reducer = Callable[[Tensor], Tensor]


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
