"""Process groups and THE collective layer: torchrun env -> torch.distributed (nccl on GPU, gloo on CPU) -> Megatron.

Every collective on a tensor in mcore-rl goes through the helpers below (a test scans the package for
`torch.distributed` collectives called anywhere else). Why one layer: NCCL moves only CUDA tensors and gloo only
CPU ones, and gloo happily accepts what NCCL refuses, so a CPU test suite cannot see a device bug at a call site.
Here the device is chosen once, from the group's own backend (`group_device`): the caller's tensor is moved to it,
reduced/broadcast/gathered there, and handed back on the caller's device. Host-side flags and pickled objects use
a gloo world group (`cpu_group()`), never a GPU byte tensor.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
from dataclasses import dataclass
from typing import Any

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


# How long a rank may wait in one collective before the process group gives up. Every group gets it: the
# default one, the gloo world group and Megatron's. The trainer passes `trainer.dist_timeout_s`
# (mcore_rl/config/trainer.py says why its default is long).
DEFAULT_TIMEOUT_S = 3600.0

_STATE: dict[str, object] = {"device": torch.device("cpu"), "cpu_group": None}
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _op(op: str):
    try:
        return _OPS[op]
    except KeyError:
        raise ValueError(f"reduce op {op!r}: expected one of {', '.join(_OPS)}") from None


def collective_device() -> torch.device:
    """Where tensors for collectives on the default backend (and Megatron's groups) must live."""
    return _STATE["device"]  # type: ignore[return-value]


def cpu_group():
    """A gloo group over the whole world for host-side values (None = the default group, already gloo)."""
    return _STATE["cpu_group"]


def backend_of(group=None) -> str:
    """The backend name of `group` (None = the default group), e.g. 'gloo', 'nccl' or 'cpu:gloo,cuda:nccl'."""
    return str(dist.get_backend(group))


def cuda_device() -> torch.device:
    """The CUDA device NCCL collectives of this process use (its current device). Patched in CPU tests."""
    return torch.device("cuda", torch.cuda.current_device())


def group_device(group=None) -> torch.device:
    """Where a tensor must live for a collective on `group`: the current CUDA device for an NCCL-only group,
    the CPU for gloo (and for mixed groups, which take CPU tensors through their gloo half)."""
    backend = backend_of(group)
    if "nccl" in backend and "gloo" not in backend:
        return cuda_device()
    return torch.device("cpu")


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else t.to(device)


def all_reduce(t: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """A fresh tensor on `t`'s device holding the reduction of `t` over `group` (`op`: sum, max or min).
    `t` itself is left untouched, so callers may pass views of tensors they still use."""
    reduce_op = _op(op)
    if not dist.is_initialized():
        return t.detach().clone()
    work = t.detach().to(group_device(group), copy=True)
    dist.all_reduce(work, op=reduce_op, group=group)
    return _on(work, t.device)


def all_gather(t: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's `t` (same shape and dtype on all ranks), in group-rank order, on `t`'s device."""
    if not dist.is_initialized():
        return [t]
    dev = group_device(group)
    local = _on(t.detach(), dev).contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return [_on(p, t.device) for p in parts]


def broadcast(t: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """`t` from global rank `src` on every rank of `group`; returned on `t`'s device (and copied into `t`).
    A side group (a weight-update group) works without a default group; only the default one may be absent."""
    if group is None and not dist.is_initialized():
        return t
    dev = group_device(group)
    work = _on(t.detach(), dev).contiguous()
    dist.broadcast(work, src=src, group=group)
    if work.device != t.device or work.data_ptr() != t.data_ptr():  # moved, or made contiguous: copy back
        t.copy_(_on(work, t.device))
    return t


def broadcast_from_group_rank(t: torch.Tensor, group_src: int, group) -> torch.Tensor:
    """`broadcast` with the source given as a rank inside `group` (for side groups with their own numbering,
    such as the trainer <-> engine weight-update groups, where the trainer is group rank 0)."""
    return broadcast(t, dist.get_global_rank(group, group_src) if group is not None else group_src, group)


def barrier(group=None) -> None:
    """All ranks of `group` (default: the gloo world) meet; no-op in a single process."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(group=group if group is not None else cpu_group())


def all_ranks_any(flag: bool) -> bool:
    """True on every rank if `flag` is true on any rank (a MAX all-reduce over the gloo world group)."""
    if not dist.is_initialized():
        return flag
    return bool(all_reduce(torch.tensor([1.0 if flag else 0.0]), "max", cpu_group()).item())


def broadcast_floats(values: list[float], src: int, group=None) -> list[float]:
    """Broadcast a few floats from global rank `src` within `group` (a Megatron group on the main backend)."""
    return broadcast(torch.tensor(values, dtype=torch.float64), src, group).tolist()


def broadcast_object(obj: Any, src: int = 0, group=None) -> Any:
    """`obj` from global rank `src` on every rank (pickled, over the gloo world group unless `group` is given);
    a no-op in a single process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group if group is not None else cpu_group())
    return box[0]


def gather_objects(obj: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's `obj` on global rank `dst` (pickled over the gloo world group: host memory, whatever the main
    backend), in rank order; None on the other ranks. A single process gets `[obj]`."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size() if global_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=cpu_group())
    return out


def send_object(obj: Any, dst: int) -> None:
    """Pickle `obj` to global rank `dst` over the gloo world group (host memory; never a GPU byte tensor)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst=dst, group=cpu_group())
    dist.send(data, dst=dst, group=cpu_group())


def recv_object(src: int) -> Any:
    """The object `send_object` sent from global rank `src`."""
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, src=src, group=cpu_group())
    data = torch.empty(int(n.item()), dtype=torch.uint8)
    dist.recv(data, src=src, group=cpu_group())
    return pickle.loads(data.numpy().tobytes())  # noqa: S301 -- our own ranks' bytes


def sum_reducer(group=None):
    """SUM all-reduce over `group` that accepts tensors on any device and returns them on the caller's device."""

    def reduce(x: torch.Tensor) -> torch.Tensor:
        return all_reduce(x, "sum", group)

    return reduce


def group_timeout_s(group=None) -> float:
    """The timeout `group` (None = the default group) was created with, read back from its backend: what a
    collective on it really waits before failing (logged at start-up, checked by tests)."""
    pg = group if group is not None else dist.group.WORLD
    return pg._get_backend(group_device(group)).options._timeout.total_seconds()


def describe_groups() -> str:
    """One line for the run's log: the backend and the timeouts the groups really got (read back from them)."""
    from megatron.core import parallel_state as ps

    return (f"process groups: backend={dist.get_backend()} world={dist.get_world_size()} "
            f"timeout_s={group_timeout_s():g} (default group), {group_timeout_s(cpu_group()):g} (host group), "
            f"{group_timeout_s(ps.get_data_parallel_group()):g} (data parallel)")


def global_rank() -> int:
    """This process's rank (0 before torch.distributed is initialised)."""
    return dist.get_rank() if dist.is_initialized() else 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    tp: int = 1, pp: int = 1, seed: int = 1234, timeout_s: float = DEFAULT_TIMEOUT_S, ep: int = 1
) -> ParallelLayout:
    """Initialise torch.distributed from torchrun's env (or a 1-process default) and Megatron's groups.

    Runs the CPU shim first when CUDA is absent, so every later Megatron call sees CPU-safe behaviour.
    `timeout_s` applies to every group created here (torch's own default for new groups is 30 min whatever the
    default group got, so it is passed to each one explicitly).
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"process-group timeout_s={timeout_s!r} must be > 0 seconds")
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
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
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
    _STATE["cpu_group"] = dist.new_group(backend="gloo", timeout=timeout) if dist.get_backend() != "gloo" else None
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not ps.model_parallel_is_initialized():
        # ep: expert-parallel ranks, carved out of data parallelism (MoE only; 1 for dense models)
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep, distributed_timeout_minutes=timeout_s / 60)
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
