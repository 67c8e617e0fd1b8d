"""Process groups: torchrun env -> torch.distributed (nccl on GPU, gloo on CPU) -> Megatron parallel_state.

The ONE place that knows which backend runs and where collective tensors must live. NCCL only moves CUDA
tensors, gloo only CPU ones, so callers never pick a device themselves: small control values (the stop flag,
PP-broadcast decisions, DP sums) go through the helpers below, which put them on `collective_device()` for
model-parallel groups and use a gloo world group (`cpu_group()`) for flags that live on the host.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    rank: int
    local_rank: int
    tp: int
    pp: int
    dp: int
    device: torch.device
    backend: str


_STATE: dict[str, object] = {"device": torch.device("cpu"), "cpu_group": None}


def collective_device() -> torch.device:
    """Where tensors for collectives on the default backend (and Megatron's groups) must live."""
    return _STATE["device"]  # type: ignore[return-value]


def cpu_group():
    """A gloo group over the whole world for host-side values (None = the default group, already gloo)."""
    return _STATE["cpu_group"]


def all_ranks_any(flag: bool) -> bool:
    """True on every rank if `flag` is true on any rank (a MAX all-reduce over the gloo world group)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu_group())
    return bool(t.item())


def broadcast_floats(values: list[float], src: int, group=None) -> list[float]:
    """Broadcast a few floats from global rank `src` within `group` (a Megatron group on the main backend)."""
    t = torch.tensor(values, dtype=torch.float64, device=collective_device())
    dist.broadcast(t, src=src, group=group)
    return t.tolist()


def broadcast_object(obj, src: int = 0):
    """`obj` from global rank `src` on every rank (pickled); a no-op in a single process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def sum_reducer(group=None):
    """SUM all-reduce over `group` that accepts tensors on any device and returns them on the caller's device."""

    def reduce(x: torch.Tensor) -> torch.Tensor:
        out = x.detach().to(collective_device(), copy=True)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out.to(x.device)

    return reduce


def global_rank() -> int:
    """This process's rank (0 before torch.distributed is initialised)."""
    return dist.get_rank() if dist.is_initialized() else 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    tp: int = 1, pp: int = 1, seed: int = 1234, timeout_s: int = 600, ep: int = 1
) -> ParallelLayout:
    """Initialise torch.distributed from torchrun's env (or a 1-process default) and Megatron's groups.

    Runs the CPU shim first when CUDA is absent, so every later Megatron call sees CPU-safe behaviour.
    """
    use_cuda = torch.cuda.is_available()
    if not use_cuda:
        from mcore_rl.compat import cpu

        cpu.apply()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by tp*pp={tp}*{pp}={tp * pp}")
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if world == 1 and "MASTER_PORT" not in os.environ:
            # one process: an in-memory store, no TCP port to pick (concurrent jobs on a node never collide)
            dist.init_process_group(backend=backend, store=dist.HashStore(), world_size=1, rank=0, timeout=timeout)
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            dist.init_process_group(backend=backend, world_size=world, rank=rank, timeout=timeout)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    _STATE["device"] = device
    # host-side flags need a gloo group when the default backend is NCCL; with gloo, WORLD already is one
    _STATE["cpu_group"] = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not ps.model_parallel_is_initialized():
        # ep: expert-parallel ranks, carved out of data parallelism (MoE only; 1 for dense models)
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    return ParallelLayout(world, rank, local_rank, tp, pp, world // (tp * pp), device, backend)


def destroy_distributed() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE.update(device=torch.device("cpu"), cpu_group=None)
