"""Process groups: torchrun env -> torch.distributed (nccl on GPU, gloo on CPU) -> Megatron parallel_state."""

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
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not ps.model_parallel_is_initialized():
        # ep: expert-parallel ranks, carved out of data parallelism (MoE only; 1 for dense models)
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    return ParallelLayout(world, rank, local_rank, tp, pp, world // (tp * pp), device, backend)


def destroy_distributed() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
