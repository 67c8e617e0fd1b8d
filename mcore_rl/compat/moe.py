"""Megatron-Core MoE on machines without Transformer Engine / CUDA (kept apart from compat/cpu.py on purpose).

Four sites in megatron-core 0.16.1 break a Mixture-of-Experts forward on CPU; each neutralisation is recorded in
`compat.cpu.HITS`-style counters (`HITS` here) so a test can show exactly what is papered over:

1. `moe_utils.te_general_gemm` is imported only inside a `try` that fails without TE, yet the router's gating
   linear reads the name unconditionally (`NameError`). Without TE the name is defined as `None`, which selects the
   plain `torch.mm` branch that upstream already has.
2. The alltoall token dispatcher copies its split sizes on a side CUDA stream and waits on an event that
   `stream.record_event()` returns. On CPU every copy is synchronous, so a stream whose `record_event` returns an
   event with a no-op `synchronize` is exact.
3. The same dispatcher turns split sizes into numpy arrays (which `all_to_all_single` accepts as sequences) only
   when they live on the GPU (`maybe_move_tensor_to_cpu(..., as_numpy=True)`); CPU tensors pass through and gloo's
   `all_to_all_single` rejects a tensor as split sizes. On CPU the numpy conversion is applied to host tensors too.
4. With TP > 1 (sequence parallel, experts TP-split) the dispatcher all-gathers / reduce-scatters tokens over the
   TP group in *uneven* splits (`output_split_sizes`): NCCL runs a list all_gather / reduce_scatter of unequal
   tensors, gloo refuses unequal sizes ("invalid tensor size") and has no list reduce_scatter. On a gloo group the
   uneven gather pads every split to the largest, gathers equal tensors and trims; the uneven reduce-scatter
   all-reduces the whole tensor and keeps this rank's split (the same sum). Even splits keep Megatron's path.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

HITS: Counter[str] = Counter()
_APPLIED = False


class _HostStream:
    """A CUDA stream/event stand-in for host-side copies that are already complete when issued."""

    def wait_stream(self, *args: Any) -> None:
        HITS["token_dispatcher.cuda_dtoh_stream.wait_stream"] += 1

    def record_event(self, *args: Any) -> _HostStream:
        HITS["token_dispatcher.cuda_dtoh_stream.record_event"] += 1
        return self

    def synchronize(self) -> None:
        HITS["token_dispatcher.d2h_event.synchronize"] += 1


def _is_gloo(group) -> bool:
    import torch.distributed as dist

    return "gloo" in str(dist.get_backend(group)) and "nccl" not in str(dist.get_backend(group))


def _uneven_tp_collectives(mappings) -> None:
    """Point 4 of the module docstring: uneven first-dim gather / reduce-scatter on gloo groups, built on Megatron's
    own even gather and all-reduce (compat sits below mcore_rl.distributed, so it issues no collective itself)."""
    gather, scatter, reduce = (mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim,
                               mappings._reduce)  # fmt: skip

    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1 or not _is_gloo(group):
            return gather(input_, group, output_split_sizes, use_global_buffer)
        HITS["tensor_parallel._gather_along_first_dim(uneven) on gloo"] += 1
        longest = max(output_split_sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = gather(padded, group).split(longest, dim=0)  # even sizes: Megatron's own all-gather
        return torch.cat([t[:n] for t, n in zip(parts, output_split_sizes)], dim=0)

    def scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1 or not _is_gloo(group):
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        HITS["tensor_parallel._reduce_scatter_along_first_dim(uneven) on gloo"] += 1
        total = reduce(input_.contiguous().clone(), group)  # in place on the clone
        start = sum(input_split_sizes[: group.rank()])
        return total[start : start + input_split_sizes[group.rank()]].clone()

    mappings._gather_along_first_dim = gather_uneven
    mappings._reduce_scatter_along_first_dim = scatter_uneven


def apply() -> bool:
    """Idempotent; returns True if anything was patched."""
    global _APPLIED
    if _APPLIED:
        return True
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    changed = False
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        HITS["moe_utils.te_general_gemm := None"] += 1
        changed = True
    if not torch.cuda.is_available():
        token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _HostStream()
        upstream = moe_utils.maybe_move_tensor_to_cpu

        def host_tensor_to_numpy(tensor, as_numpy: bool = False, record_stream: bool = False):
            if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
                HITS["maybe_move_tensor_to_cpu(as_numpy) on a host tensor"] += 1
                return tensor.numpy()
            return upstream(tensor, as_numpy=as_numpy, record_stream=record_stream)

        token_dispatcher.maybe_move_tensor_to_cpu = host_tensor_to_numpy
        from megatron.core.tensor_parallel import mappings

        _uneven_tp_collectives(mappings)
        changed = True
    _APPLIED = True
    return changed
