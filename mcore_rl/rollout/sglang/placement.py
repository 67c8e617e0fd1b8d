"""Which GPUs each launched rollout server gets (its CUDA_VISIBLE_DEVICES), from the node's visible devices.

Why here and not in SGLang: every SGLang server allocates from `--base-gpu-id` (default 0), so N servers
started without a placement all land on GPU 0, next to the trainer. Each server gets its own slice of the
node's visible devices as CUDA_VISIBLE_DEVICES instead (ids as the parent sees them: physical ids, or UUIDs
when CUDA_VISIBLE_DEVICES holds those), and sees them as 0..tp-1.

Disaggregated (default): the trainer's ranks on this node hold the first `trainer_gpus` visible devices
(torchrun's local rank r uses cuda:r); the servers take the next ones. Colocated: the servers share the trainer's
devices (their weights are released between rounds through SGLang's memory saver).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


def cuda_device_count() -> int:
    """Devices torch sees (0 without CUDA). A function of its own so CPU tests can patch the device query."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def visible_gpus(environ: dict[str, str] | None = None) -> list[str]:
    """The node's GPUs as the launcher's children would name them: CUDA_VISIBLE_DEVICES entries when set (an
    empty value hides every device), else 0..device_count-1."""
    env = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in env:
        return [tok.strip() for tok in env["CUDA_VISIBLE_DEVICES"].split(",") if tok.strip()]
    return [str(i) for i in range(cuda_device_count())]


def trainer_gpus_on_node(environ: dict[str, str] | None = None) -> int:
    """Trainer processes on this node: torchrun's LOCAL_WORLD_SIZE, else 1 (a single-process run)."""
    env = os.environ if environ is None else environ
    return int(env.get("LOCAL_WORLD_SIZE", "1"))


@dataclass(frozen=True)
class Placement:
    per_server: list[list[str]]  # server i -> its devices; [] each when the node has no GPU (CPU stand-ins)
    visible: list[str]
    trainer_gpus: int
    colocate: bool


def place_servers(
    num_servers: int,
    tp_size: int,
    *,
    colocate: bool = False,
    gpu_ids: list[int] | None = None,
    visible: list[str] | None = None,
    trainer_gpus: int | None = None,
) -> Placement:
    """Device slices for `num_servers` servers of `tp_size` GPUs each. Explicit `gpu_ids` win (slice i*tp..).

    Raises ConfigError (one line, with the numbers) when the node has too few GPUs. A node without GPUs gets
    no placement at all: the CPU stand-in server (mcore-rl-serve) runs there.
    """
    from mcore_rl.config.checks import ConfigError

    need = num_servers * tp_size
    vis = visible_gpus() if visible is None else list(visible)
    n_trainer = trainer_gpus_on_node() if trainer_gpus is None else trainer_gpus
    if gpu_ids is not None:
        ids = [str(g) for g in gpu_ids]
        return Placement(
            [ids[i * tp_size : (i + 1) * tp_size] for i in range(num_servers)], vis, n_trainer, colocate
        )
    if not vis:
        return Placement([[] for _ in range(num_servers)], vis, n_trainer, colocate)
    if colocate:
        if need > len(vis):
            raise ConfigError(
                f"rollout.launcher.colocate=true: {num_servers} servers x tp_size {tp_size} = {need} "
                f"GPUs but this node has {len(vis)} visible ({','.join(vis)})"
            )
        pool = vis[:need]
    else:
        if n_trainer + need > len(vis):
            raise ConfigError(
                f"rollout.launcher: {num_servers} servers x tp_size {tp_size} = {need} GPUs + {n_trainer} trainer "
                f"GPUs (LOCAL_WORLD_SIZE) > {len(vis)} visible on this node ({','.join(vis)}); lower "
                "rollout.launcher.num_servers/tp_size, set rollout.launcher.colocate=true, or give "
                "rollout.launcher.gpu_ids"
            )
        pool = vis[n_trainer : n_trainer + need]
    return Placement(
        [pool[i * tp_size : (i + 1) * tp_size] for i in range(num_servers)], vis, n_trainer, colocate
    )
