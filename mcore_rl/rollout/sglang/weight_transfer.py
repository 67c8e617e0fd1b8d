"""How an SGLang engine receives full HF tensors without a folder: CUDA IPC (colocated) or a broadcast group.

tensor -- colocated only (same node, the engine's GPUs visible to this process): per bucket, one payload per
          engine TP rank, each a ForkingPickler dump of a copy on THAT rank's GPU (after SGLang's
          torch-reductions patch, so devices travel as GPU UUIDs) -> /update_weights_from_tensor on each worker.
nccl   -- disaggregated: /update_weights_from_distributed announces a bucket while rank 0 broadcasts it.
Tensors stream through bucket by bucket (one bucket of lookahead tags the last one with the version and the
cache flush), so the trainer never materialises the whole model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from mcore_rl.rollout.sglang.api import (
    bucket_named_tensors,
    distributed_update_payload,
    serialize_per_rank,
    tensor_update_payload,
)

T = TypeVar("T")
_END = object()


def with_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """(item, is_last) with one item of lookahead."""
    it = iter(items)
    cur = next(it, _END)
    while cur is not _END:
        nxt = next(it, _END)
        yield cur, nxt is _END
        cur = nxt


def rank_devices(tp_size: int) -> list[torch.device]:
    """The device engine TP rank i reads from: GPU i of this node when CUDA is up (colocated), else CPU."""
    if torch.cuda.is_available():
        return [torch.device("cuda", i % torch.cuda.device_count()) for i in range(tp_size)]
    return [torch.device("cpu")] * tp_size


@contextmanager
def _update(engine) -> Iterator[dict[str, bool]]:
    """Around a bucketed update: in interrupt mode the first bucket aborts everything in flight and new sends
    wait until the last bucket is in (so no sample sees half an update)."""
    engine._lt.run(engine.client.begin_update())
    try:
        yield engine.client.interrupts.payload()
    finally:
        engine._lt.run(engine.client.end_update())


def send_ipc(engine, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
    devices = rank_devices(engine.tp_size)
    with _update(engine) as first:
        for bucket, last in with_last(bucket_named_tensors(named_tensors, engine.bucket_bytes)):
            payloads, _alive = serialize_per_rank(bucket, devices)  # copies live until every worker answered
            payload = {**tensor_update_payload(payloads, version if last else None, flush_cache=last), **first}
            first = {}
            for url in engine.cfg.worker_urls:
                engine._lt.run(engine.client.update_weights_from_tensor(url, payload))
    engine.client.weight_version = int(version)


def init_group(engine, master_address: str, master_port: int, group_name: str, backend: str) -> Any:
    """The servers' HTTP joins and our own rendezvous must overlap: submit the former, then block on ours."""
    from mcore_rl.rollout.weight_sync.dist_group import init_weight_update_group

    tp_sizes = [engine.tp_size] * len(engine.cfg.worker_urls)
    fut = engine._lt.submit(
        engine.client.init_weights_update_group(master_address, master_port, tp_sizes, group_name, backend)
    )
    group = init_weight_update_group(master_address, master_port, 0, 1 + sum(tp_sizes), group_name, backend)
    fut.result()
    engine.groups[group_name] = group
    return group


def broadcast(
    engine, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, group_name: str | None = None
) -> None:
    """Per bucket: POST the names/dtypes/shapes to every server, broadcast the tensors, await the replies.

    Without a group yet, creates one from engine.nccl = {master_address, master_port[, backend, group_name]}.
    """
    import torch.distributed as dist

    if not engine.groups:
        if not engine.nccl.get("master_address") or not engine.nccl.get("master_port"):
            raise ValueError("sync_mode=nccl needs rollout.nccl.master_address and rollout.nccl.master_port")
        init_group(
            engine, engine.nccl["master_address"], engine.nccl["master_port"],
            engine.nccl.get("group_name", "weight_update_group"), engine.nccl.get("backend", "nccl"),
        )  # fmt: skip
    group_name = group_name or next(iter(engine.groups))
    if group_name not in engine.groups:
        raise RuntimeError(f"no weight-update group {group_name!r}: call init_weights_update_group() first")
    group = engine.groups[group_name]
    with _update(engine) as first:
        for bucket, last in with_last(bucket_named_tensors(named_tensors, engine.bucket_bytes)):
            payload = distributed_update_payload(bucket, group_name, version if last else None, flush_cache=last)
            payload, first = {**payload, **first}, {}
            fut = engine._lt.submit(engine.client.update_weights_from_distributed(payload))
            for _, t in bucket:
                dist.broadcast(t.contiguous(), src=0, group=group)
            fut.result()
    engine.client.weight_version = int(version)
