"""A side process group between a trainer rank (group rank 0) and SGLang engine ranks, for NCCL weight broadcast.

Why not `init_process_group`: the trainer already has its default world; the weight-update group is a second,
independent one (the stage source of each PP stage hosts one; see pp_broadcast.py). SGLang's server joins with the same recipe (TCP rendezvous, a store prefixed by the group
name, a fresh backend), so both sides meet; the trainer must be rank 0 (it hosts the TCP store).
Works with gloo too, which is how it is tested on CPU.
"""

from __future__ import annotations

import inspect
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def init_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "nccl",
    timeout_s: float = 600.0,
) -> dist.ProcessGroup:
    """Join (rank 0: host) a standalone process group; independent of any default process group."""
    timeout = timedelta(seconds=timeout_s)
    # A TCPStore of our own, not c10d.rendezvous: under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) rendezvous
    # makes even rank 0 a client of a store it expects the elastic agent to host, and nobody hosts this one.
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)  # fmt: skip
    store = c10d.PrefixStore(group_name, store)
    params = inspect.signature(c10d._new_process_group_helper).parameters
    options = {"backend_options": None} if "backend_options" in params else {"pg_options": None}
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), store, group_name=group_name, timeout=timeout, **options
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_weight_update_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)
