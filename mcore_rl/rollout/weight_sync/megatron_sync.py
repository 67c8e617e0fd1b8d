"""Weight sync from the (TP/PP-sharded) Megatron policy to a rollout engine, tagged with a version.

The policy's adapter stream yields full HF-named tensors on global rank 0 (TP shards all-gathered, PP stages
shipped to rank 0); a transport from `transports.py` (disk | tensor | nccl) carries them to the engine.
"""

from __future__ import annotations

import time

from mcore_rl.distributed import global_rank
from mcore_rl.rollout.weight_sync.transports import SyncOptions, send_weights


def sync_weights(
    policy,
    engine,
    version: int,
    mode: str = "tensor",
    options: SyncOptions | None = None,
) -> dict[str, float]:
    """Collective: every rank calls; only rank 0 talks to the engine, through the `mode` transport.
    Returns {sync_s, sync_gb}."""
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

    send_weights(mode, engine, counted(), version, options or SyncOptions())
    dt = time.perf_counter() - t0
    return {"sync_s": dt, "sync_gb": nbytes / 1e9}
