"""The nccl transport for a (TP/PP-sharded) trainer: one weight-update group per PP stage, as slime does.

Group `<base>_pp<s>` = the stage's (DP=0, TP=0) rank as group rank 0 (it hosts the rendezvous) + every engine TP
rank of every server. Trainer rank 0 alone talks HTTP: it asks the servers to join each group and announces
each bucket (/update_weights_from_distributed, names/dtypes/shapes), while the stage's source broadcasts the
bucket's flat buffer on its own group. A later stage's source sends the (small) bucket metadata to rank 0 over
the gloo world group; no stage is ever pickled or shipped to rank 0, and tensors only ever sit on the group's
device (`distributed.group_device`: CUDA for NCCL, CPU for gloo).

Stages go strictly one after another: rank 0 announces stage s+1 only after every bucket of stage s is in. If
several sources broadcast at once, a server handling their announcements in another order than the sources
broadcast would wait in one group while the source waits in another: a deadlock.

Group membership changes when a server restarts (it lost its side of every group): rank 0 says so in the sync
plan and every source destroys its groups and hosts them again before sending (the client's join destroys the
servers' stale side first).
"""

from __future__ import annotations

import socket
from typing import Any

from mcore_rl import distributed as D
from mcore_rl.policy.weight_stream import MemoryMeter, stage_buckets, stage_src_rank
from mcore_rl.rollout.weight_sync.dist_group import destroy_weight_update_group, init_weight_update_group

# this process's side of each stage group it is the source of (name -> process group)
_GROUPS: dict[str, Any] = {}


def group_name(base: str, stage: int) -> str:
    return f"{base}_pp{stage}"


def plan_for(engine, pp_size: int) -> dict:
    """Rank 0: what every rank must know before a distributed sync (broadcast to all)."""
    from mcore_rl.rollout.sglang import weight_transfer as wt

    nccl = engine.nccl
    if not nccl.get("master_address") or not nccl.get("master_port"):
        raise ValueError("sync_mode=nccl needs rollout.nccl.master_address and rollout.nccl.master_port")
    base = nccl.get("group_name", "weight_update_group")
    restarted = engine.take_restarted()
    ready = all(group_name(base, s) in engine.stage_groups for s in range(pp_size))
    return {
        "base": base, "address": nccl["master_address"], "port": int(nccl["master_port"]),
        "backend": nccl.get("backend", "nccl"), "world": wt.group_world(engine), "host": socket.gethostname(),
        "init": bool(restarted) or not ready, "restarted": restarted,
    }  # fmt: skip


def _address(plan: dict) -> str:
    """Where this stage source's rendezvous listens: rank 0's configured address on rank 0's node, else ours."""
    if socket.gethostname() == plan["host"]:
        return plan["address"]
    return socket.gethostbyname(socket.gethostname())


def _init_groups(engine, plan: dict, pp_size: int) -> None:
    """Each stage's source hosts its group while rank 0 asks the servers to join; stage by stage."""
    from mcore_rl.rollout.sglang import weight_transfer as wt

    rank = D.global_rank()
    for s in range(pp_size):
        src, name, port = stage_src_rank(s), group_name(plan["base"], s), plan["port"] + s
        if rank == src and name in _GROUPS:
            destroy_weight_update_group(_GROUPS.pop(name))
        if rank == src:
            address = _address(plan)
            if src != 0:
                D.send_object(address, 0)
        elif rank == 0:
            address = D.recv_object(src)
        if rank == 0:
            join = wt.post_join(engine, address, port, name, plan["backend"])
        if rank == src:
            _GROUPS[name] = init_weight_update_group(address, port, 0, plan["world"], name, plan["backend"])
        if rank == 0:
            join.result()
            engine.stage_groups.add(name)


def sync_stages(policy, engine, version: int, bucket_bytes: int, meter: MemoryMeter) -> int:
    """Collective (every rank): send the policy's weights to the servers by one group per PP stage. Rank 0
    holds `engine`; other ranks pass None. Returns the bytes sent (rank 0's count, 0 elsewhere)."""
    from megatron.core import parallel_state as ps

    from mcore_rl.rollout.sglang import weight_transfer as wt

    rank = D.global_rank()
    pp_size = ps.get_pipeline_model_parallel_world_size()
    my_stage = ps.get_pipeline_model_parallel_rank()
    plan = D.broadcast_object(plan_for(engine, pp_size) if rank == 0 else None, 0)
    if plan["init"]:
        _init_groups(engine, plan, pp_size)
    sent = 0

    def announce(meta: dict, stage: int, first: dict):
        last = stage == pp_size - 1 and meta["last"]
        payload = {**wt.distributed_payload(meta, group_name(plan["base"], stage), version if last else None,
                                            last), **first}  # fmt: skip
        return wt.post_bucket(engine, payload)

    session = wt.update_session(engine) if rank == 0 else None
    first = session.__enter__() if session is not None else {}
    try:
        for s in range(pp_size):
            src, name = stage_src_rank(s), group_name(plan["base"], s)
            if s == my_stage:
                for bucket in stage_buckets(policy.model, policy.family, policy.args, bucket_bytes, meter,
                                            keep=rank == src):  # fmt: skip
                    meta = bucket.meta()
                    fut = None
                    if rank == 0:
                        fut, first = announce(meta, s, first), {}
                        sent += meta["nbytes"]
                    else:
                        D.send_object(meta, 0)
                    D.broadcast_from_group_rank(bucket.data[: bucket.used], 0, _GROUPS[name])
                    if fut is not None:
                        fut.result()
                if rank == src and src != 0:
                    D.send_object(None, 0)
            elif rank == 0:
                while (meta := D.recv_object(src)) is not None:
                    announce(meta, s, first).result()
                    first = {}
                    sent += meta["nbytes"]
    finally:
        if session is not None:
            session.__exit__(None, None, None)
    if rank == 0:
        engine.client.weight_version = int(version)
        engine.sync_mode_seen = "nccl"
        engine.mark_resynced(engine.cfg.worker_urls)  # every member of every group got these weights
    return sent
