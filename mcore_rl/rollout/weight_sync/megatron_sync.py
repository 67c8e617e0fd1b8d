"""Weight sync from the (TP/PP-sharded) Megatron policy to a rollout engine, tagged with a version.

The policy's adapter stream yields full HF-named tensors on global rank 0 (TP shards all-gathered, PP stages
shipped to rank 0). Destinations: an in-process engine (tensors copied in place), or a server via disk (an atomic
safetensors folder + `update_weights_from_disk`). The NCCL broadcast path lives in the SGLang client.
"""

from __future__ import annotations

import time
from pathlib import Path

from mcore_rl.distributed import global_rank


def sync_weights(
    policy,
    engine,
    version: int,
    mode: str = "tensor",
    disk_dir: str | Path | None = None,
    config_dir: str | Path | None = None,
    bucket_mb: float = 512.0,
) -> dict[str, float]:
    """Collective: every rank calls; only rank 0 talks to the engine. Returns {sync_s, sync_gb}."""
    t0 = time.perf_counter()
    stream = policy.hf_tensors(dst=0)
    nbytes = 0
    if global_rank() != 0 or engine is None:
        for _ in stream:
            pass
        return {"sync_s": time.perf_counter() - t0}

    def counted():
        nonlocal nbytes
        for name, t in stream:
            nbytes += t.numel() * t.element_size()
            yield name, t

    if mode == "tensor":
        engine.update_weights(counted(), version)
    elif mode == "disk":
        from mcore_rl.rollout.weight_sync.disk_sync import versioned_dir, write_hf_folder

        if disk_dir is None:
            raise ValueError("rollout.sync_mode=disk needs rollout.sync_dir")
        out = versioned_dir(disk_dir, version)
        write_hf_folder(counted(), out, config_dir=config_dir, bucket_mb=bucket_mb, overwrite=True)
        engine.update_weights_from_disk(str(out), version)
    else:
        raise ValueError(f"rollout.sync_mode={mode!r}: expected tensor or disk")
    dt = time.perf_counter() - t0
    return {"sync_s": dt, "sync_gb": nbytes / 1e9}
