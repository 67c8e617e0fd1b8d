"""How an SGLang engine receives full HF tensors without a folder: CUDA IPC (colocated) or broadcast groups.

Both send SGLang 0.5.23's `load_format="flattened_bucket"` (weight_sync/flat_bucket.py): one flat buffer per
bucket instead of one tensor (one IPC handle or one broadcast) per weight.
tensor -- colocated only (same node, the engine's GPUs visible to this process): per bucket and per server, one
          payload per engine TP rank, each a flat copy on THAT rank's own GPU (server i's ranks sit on
          launcher.gpu_ids[i*tp:(i+1)*tp]); the handles are dropped and `torch.cuda.ipc_collect()` runs once every
          server has answered. On CPU the same path sends shared-memory tensors (mcore-rl-serve reads them).
nccl   -- disaggregated: /update_weights_from_distributed announces a bucket while the group's rank 0 broadcasts
          it. With pipeline parallelism there is one group per stage (megatron_sync / pp_broadcast.py); the
          single-group path here serves a trainer without PP.
Tensors stream through bucket by bucket (one bucket of lookahead tags the last one with the version and the
cache flush), so the trainer never materialises the whole model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from mcore_rl import distributed as D
from mcore_rl.rollout.sglang.api import check_payload, serialize_named_tensors
from mcore_rl.rollout.weight_sync import flat_bucket

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


def rank_devices(tp_size: int, gpu_ids: list[int] | None = None, server: int = 0) -> list[torch.device]:
    """The device engine TP rank i of server `server` reads from: its own GPU when CUDA is up (colocated; the
    launcher gives server k the GPUs gpu_ids[k*tp:(k+1)*tp], else every server uses GPUs 0..tp-1), else CPU."""
    if not torch.cuda.is_available():
        return [torch.device("cpu")] * tp_size
    n = torch.cuda.device_count()
    if gpu_ids is not None:
        return [torch.device("cuda", gpu_ids[server * tp_size + i] % n) for i in range(tp_size)]
    return [torch.device("cuda", i % n) for i in range(tp_size)]


@contextmanager
def update_session(engine) -> Iterator[dict[str, bool]]:
    """Around a bucketed update: the client opens SGLang's weight-update session; in interrupt mode the first
    bucket aborts everything in flight and new sends wait until the last bucket is in (no sample sees half an
    update). Yields the fields the first bucket carries."""
    engine._lt.run(engine.client.begin_update())
    try:
        yield engine.client.interrupts.payload()
    finally:
        engine._lt.run(engine.client.end_update())


# ---------------------------------------------------------------------------- tensor (colocated IPC)
def ipc_payload(named: list[tuple[str, torch.Tensor]], devices: list[torch.device]) -> tuple[list[str], list]:
    """One flattened-bucket payload per engine TP rank, each from a flat copy on that rank's device (one copy per
    distinct device). Returns the payloads and the copies, which must live until the server has answered."""
    from mcore_rl.rollout.sglang.api import patch_torch_reductions

    patch_torch_reductions()
    spec = [(n, t.shape, t.dtype) for n, t in named]
    flats: dict[torch.device, torch.Tensor] = {}
    payloads = []
    for dev in devices:
        if dev not in flats:
            flats[dev] = flat_bucket.flatten(named, dev)
        payloads.append(serialize_named_tensors(flat_bucket.tensor_bucket(flats[dev], spec)))  # type: ignore[arg-type]
    return payloads, list(flats.values())


def tensor_payload(payloads: list[str], version: int | None, flush_cache: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "serialized_named_tensors": payloads, "load_format": flat_bucket.LOAD_FORMAT, "flush_cache": flush_cache,
    }  # fmt: skip
    if version is not None:
        out["weight_version"] = str(version)
    check_payload("/update_weights_from_tensor", out)
    return out


def send_ipc(
    engine, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, urls: list[str] | None = None
) -> None:
    """Every bucket to every server in `urls` (default: all), each server's TP ranks on their own devices."""
    urls = list(engine.cfg.worker_urls if urls is None else urls)
    index = {u: i for i, u in enumerate(engine.cfg.worker_urls)}
    gpu_ids = getattr(engine, "gpu_ids", None)
    with update_session(engine) as first:
        for bucket, last in with_last(flat_bucket.flat_groups(named_tensors, engine.bucket_bytes)):
            futures, alive = [], []
            for url in urls:
                payloads, copies = ipc_payload(bucket, rank_devices(engine.tp_size, gpu_ids, index[url]))
                alive.append(copies)
                body = {**tensor_payload(payloads, version if last else None, flush_cache=last), **first}
                futures.append(engine._lt.submit(engine.client.update_weights_from_tensor(url, body)))
            first = {}
            for f in futures:
                f.result()
            del alive  # every server has loaded this bucket: its IPC copies can go
            if torch.cuda.is_available():
                torch.cuda.ipc_collect()
    engine.client.weight_version = int(version)


# ---------------------------------------------------------------------------- nccl (broadcast groups)
def distributed_payload(
    meta: dict, group_name: str, version: int | None, flush_cache: bool
) -> dict[str, Any]:
    """/update_weights_from_distributed body announcing one flat bucket (`weight_stream.Bucket.meta()`)."""
    out: dict[str, Any] = {
        "names": list(meta["names"]), "dtypes": list(meta["dtypes"]), "shapes": [list(s) for s in meta["shapes"]],
        "group_name": group_name, "flush_cache": flush_cache, "load_format": flat_bucket.LOAD_FORMAT,
    }  # fmt: skip
    if version is not None:
        out["weight_version"] = str(version)
    check_payload("/update_weights_from_distributed", out)
    return out


def post_join(engine, master_address: str, master_port: int, group_name: str, backend: str) -> Future:
    """Ask every server to join group `group_name` (ranks 1..); the caller hosts rank 0 meanwhile."""
    tp_sizes = [engine.tp_size] * len(engine.cfg.worker_urls)
    return engine._lt.submit(
        engine.client.init_weights_update_group(master_address, master_port, tp_sizes, group_name, backend)
    )


def group_world(engine) -> int:
    return 1 + engine.tp_size * len(engine.cfg.worker_urls)


def post_bucket(engine, payload: dict) -> Future:
    return engine._lt.submit(engine.client.update_weights_from_distributed(payload))


def init_group(engine, master_address: str, master_port: int, group_name: str, backend: str) -> Any:
    """The servers' HTTP joins and our own rendezvous must overlap: submit the former, then block on ours."""
    from mcore_rl.rollout.weight_sync.dist_group import init_weight_update_group

    fut = post_join(engine, master_address, master_port, group_name, backend)
    group = init_weight_update_group(master_address, master_port, 0, group_world(engine), group_name, backend)
    fut.result()
    engine.groups[group_name] = group
    return group


def broadcast(
    engine, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, group_name: str | None = None
) -> None:
    """Per flat bucket: POST its names/dtypes/shapes to every server, broadcast the buffer, await the replies.

    Without a group yet, creates one from engine.nccl = {master_address, master_port[, backend, group_name]}.
    """
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
    device = D.group_device(group)
    with update_session(engine) as first:
        for bucket, last in with_last(flat_bucket.flat_groups(named_tensors, engine.bucket_bytes)):
            meta = {
                "names": [n for n, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
            }  # fmt: skip
            payload = {**distributed_payload(meta, group_name, version if last else None, last), **first}
            first = {}
            fut = post_bucket(engine, payload)
            D.broadcast_from_group_rank(flat_bucket.flatten(bucket, device), 0, group)
            fut.result()
    engine.client.weight_version = int(version)
