"""Weight-sync transports: how full HF-named tensors from the trainer reach an engine. One registry, keyed by
`rollout.sync_mode`; every transport is `send(engine, named_tensors, version, options)`.

disk   -- a versioned safetensors folder (atomic) every server can read, then update_weights_from_disk on the
          engine; old `v<N>` folders are pruned to `keep_versions` after each successful update and stale temp
          folders from a crashed writer are removed first. Works for any engine and any topology; a restarted
          SGLang server replays the newest folder before it counts as up.
tensor -- engine.update_weights: an in-place copy for the local engine; flat buckets by CUDA IPC (shared memory
          on CPU) for colocated SGLang.
nccl   -- engine.update_weights_from_distributed: a broadcast group between trainer rank 0 and the servers. A
          Megatron trainer with an SGLang engine does not come here: megatron_sync runs one group per PP stage
          (pp_broadcast.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from mcore_rl.registry import Registry
from mcore_rl.rollout.weight_sync import disk_sync


@dataclass
class SyncOptions:
    sync_dir: str | Path | None = None  # disk: root of the v<N> folders (shared by trainer and servers)
    config_dir: str | Path | None = None  # disk: config/tokenizer files copied next to the weights
    keep_versions: int = 2  # disk: newest folders kept (>= 1: a restarted server is re-synced from the newest)
    bucket_mb: float = 512.0

    def __post_init__(self) -> None:
        if self.keep_versions < 1:
            raise ValueError(f"rollout.keep_versions={self.keep_versions} must be >= 1")


# rollout.* keys the trainer reads for weight sync; the engine gets every other key of the rollout config
TRAINER_KEYS = ("sync_mode", "sync_dir", "keep_versions")
Transport = Callable[[object, Iterable[tuple[str, torch.Tensor]], int, SyncOptions], None]
TRANSPORTS: Registry[Transport] = Registry("rollout.sync_mode", {name: __name__ for name in ("disk", "tensor", "nccl")})


def register_transport(name: str) -> Callable[[Transport], Transport]:
    return TRANSPORTS.register(name)


def send_weights(
    mode: str, engine, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, options: SyncOptions
) -> None:
    TRANSPORTS.get(mode)(engine, named_tensors, version, options)


@register_transport("disk")
def send_disk(engine, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, opt: SyncOptions) -> None:
    if opt.sync_dir is None:
        raise ValueError("rollout.sync_mode=disk needs rollout.sync_dir (a folder every server can read)")
    disk_sync.remove_stale_temp(opt.sync_dir)
    out = disk_sync.write_hf_folder(
        named_tensors, disk_sync.versioned_dir(opt.sync_dir, version), config_dir=opt.config_dir,
        bucket_mb=opt.bucket_mb, overwrite=True,
    )  # fmt: skip
    engine.update_weights_from_disk(str(out), version)
    disk_sync.prune_versions(opt.sync_dir, opt.keep_versions)


@register_transport("tensor")
def send_tensor(engine, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, opt: SyncOptions) -> None:
    engine.update_weights(named_tensors, version)


@register_transport("nccl")
def send_nccl(engine, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, opt: SyncOptions) -> None:
    if not hasattr(engine, "update_weights_from_distributed"):
        raise ValueError(f"rollout.sync_mode=nccl needs an engine with a broadcast group; {type(engine).__name__} has none")
    engine.update_weights_from_distributed(named_tensors, version)
