"""Ranks agree on a yes/no with one all-reduce, on the device the process group's backend needs.

Why one module: a fault (non-finite loss on one rank, a full disk under one rank's shard) must turn into the same
decision on every rank, or the ranks diverge into a collective that never completes (a 10-minute hang). One
MAX all-reduce of a small tensor is that decision; NCCL needs the tensor on the current CUDA device, gloo on CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def collective_device(group=None) -> torch.device:
    """Where a tensor must live for a collective on `group` (default: the world group)."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_max(values: list[float], group=None) -> list[float]:
    """Element-wise max over all ranks of `group` (identity without a process group). NaN-safe: callers send
    flags, never raw values that may be NaN."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu().tolist()


def any_rank(flag: bool, group=None) -> bool:
    """True on every rank when `flag` is True on at least one."""
    return all_reduce_max([1.0 if flag else 0.0], group)[0] > 0


class FatalRunError(RuntimeError):
    """A run cannot go on (too many non-finite updates, a failed checkpoint save, a reward that keeps crashing):
    the entry point prints its message as one line and exits non-zero."""
