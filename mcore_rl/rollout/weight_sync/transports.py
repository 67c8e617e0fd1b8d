"""How `SGLangEngine.update_weights` ships full HF tensors to the servers: a registry of strategies.

disk   -- a versioned safetensors folder every server can read, then /update_weights_from_disk (any setup).
tensor -- colocated: CUDA IPC handles per bucket via /update_weights_from_tensor (same node, same GPUs).
nccl   -- disaggregated: /update_weights_from_distributed announces a bucket while rank 0 broadcasts it.
Tensors stream through bucket by bucket (one bucket of lookahead to tag the last one with the version), so
the trainer never materialises the whole model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

from mcore_rl.rollout.sglang.api import (
    bucket_named_tensors,
    distributed_update_payload,
    serialize_named_tensors,
    tensor_update_payload,
)
from mcore_rl.rollout.weight_sync import disk_sync

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


def sync_disk(engine, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
    """Write weight_dir/v<version> atomically, load it on every server, prune old versions."""
    if not engine.weight_dir:
        raise ValueError("weight_sync='disk' needs weight_dir (a folder every server can read)")
    path = disk_sync.write_hf_folder(
        named_tensors, disk_sync.versioned_dir(engine.weight_dir, version), config_dir=engine.model_path,
        bucket_mb=engine.bucket_bytes / 2**20, overwrite=True,
    )  # fmt: skip
    engine.update_weights_from_disk(str(path), version)
    disk_sync.prune_versions(engine.weight_dir, engine.keep_versions)


def sync_tensor(engine, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
    """Colocated: one serialized bucket per engine TP rank; the last bucket carries version and flush."""
    for bucket, last in with_last(bucket_named_tensors(named_tensors, engine.bucket_bytes)):
        payload = tensor_update_payload(
            [serialize_named_tensors(bucket)] * engine.tp_size, version if last else None, flush_cache=last
        )
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


def broadcast_update(
    engine, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, group_name: str | None = None
) -> None:
    """Per bucket: POST the names/dtypes/shapes to every server, broadcast the tensors, await the replies."""
    import torch.distributed as dist

    group_name = group_name or next(iter(engine.groups), None)
    if group_name not in engine.groups:
        raise RuntimeError(f"no weight-update group {group_name!r}: call init_weights_update_group() first")
    group = engine.groups[group_name]
    for bucket, last in with_last(bucket_named_tensors(named_tensors, engine.bucket_bytes)):
        payload = distributed_update_payload(bucket, group_name, version if last else None, flush_cache=last)
        fut = engine._lt.submit(engine.client.update_weights_from_distributed(payload))
        for _, t in bucket:
            dist.broadcast(t.contiguous(), src=0, group=group)
        fut.result()
    engine.client.weight_version = int(version)


def sync_nccl(engine, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
    """Create the group on first use from engine.nccl = {master_address, master_port[, backend, group_name]}."""
    if not engine.groups:
        if not engine.nccl.get("master_address") or not engine.nccl.get("master_port"):
            raise ValueError("weight_sync='nccl' needs nccl.master_address and nccl.master_port")
        init_group(
            engine, engine.nccl["master_address"], engine.nccl["master_port"],
            engine.nccl.get("group_name", "weight_update_group"), engine.nccl.get("backend", "nccl"),
        )  # fmt: skip
    broadcast_update(engine, named_tensors, version)


WEIGHT_SYNC: dict[str, Callable[..., None]] = {"disk": sync_disk, "tensor": sync_tensor, "nccl": sync_nccl}
