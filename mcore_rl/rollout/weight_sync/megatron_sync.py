"""Weight sync from the (TP/PP-sharded) Megatron policy to a rollout engine, tagged with a version.

Every rank gathers its stage parameter by parameter into flat buckets (policy/weight_stream.py). Then:
- nccl with an engine that has broadcast groups (SGLang): one group per PP stage, each stage's source broadcasts
  its own buckets (pp_broadcast.py);
- every other transport (disk, tensor, the embedded engine): buckets reach global rank 0 one at a time and the
  `mode` transport from `transports.py` carries the HF-named tensors to the engine.
Metrics: sync_s, sync_gb and sync_peak_extra_mb = the most memory any rank's stream held beyond the model
(one bucket + one gathered parameter at most; sync_bound_mb is that bound).
"""

from __future__ import annotations

import time

import torch

from mcore_rl import distributed as D
from mcore_rl.policy.weight_stream import MemoryMeter
from mcore_rl.rollout.weight_sync.transports import SyncOptions, send_weights


def _distributed(engine, mode: str) -> bool:
    """Rank 0 decides (only it holds the engine); every rank learns the answer."""
    here = mode == "nccl" and engine is not None and hasattr(engine, "stage_groups")
    return bool(D.broadcast_object(here if D.global_rank() == 0 else None, 0))


def sync_weights(
    policy,
    engine,
    version: int,
    mode: str = "tensor",
    options: SyncOptions | None = None,
) -> dict[str, float]:
    """Collective: every rank calls; only rank 0 talks to the engine. Returns {sync_s, sync_gb,
    sync_peak_extra_mb, sync_bound_mb} (rank 0's view; the memory numbers are the max over ranks)."""
    from mcore_rl.policy.hf_weights import iter_hf_tensors

    opt = options or SyncOptions()
    t0 = time.perf_counter()
    meter = MemoryMeter()
    bucket_bytes = int(opt.bucket_mb * 2**20)
    nbytes = 0
    if _distributed(engine, mode):
        from mcore_rl.rollout.weight_sync.pp_broadcast import sync_stages

        nbytes = sync_stages(policy, engine, version, bucket_bytes, meter)
    else:
        stream = iter_hf_tensors(policy.model, policy.family, policy.args, 0, bucket_bytes, meter)
        if D.global_rank() != 0 or engine is None:
            for _ in stream:
                pass
        else:

            def counted():
                nonlocal nbytes
                for name, t in stream:
                    nbytes += t.numel() * t.element_size()
                    yield name, t

            send_weights(mode, engine, counted(), version, opt)
    mem = D.all_reduce(torch.tensor([meter.peak, meter.bound], dtype=torch.float64), "max", D.cpu_group())
    out = {"sync_s": time.perf_counter() - t0, "sync_peak_extra_mb": mem[0].item() / 2**20,
           "sync_bound_mb": mem[1].item() / 2**20}  # fmt: skip
    if D.global_rank() == 0 and engine is not None:
        out["sync_gb"] = nbytes / 1e9
    return out


def resync_restarted(policy, engine, options: SyncOptions | None = None) -> dict[str, float]:
    """Collective: re-send the current weights (the engine's current version) to servers that restarted since
    they were last synced; a no-op on every rank when none did. Rank 0 alone knows (the launcher tells it), so it
    decides and every rank follows (`broadcast_object`).

    disk: the engine already replayed the newest folder on restart, nothing to do. tensor: the weights go to the
    restarted servers only. nccl: every stage group is rebuilt with the new membership and the weights are
    broadcast again (a broadcast reaches every member)."""
    pending = engine.pending_resync() if D.global_rank() == 0 and engine is not None else []
    pending = D.broadcast_object(pending, 0)
    if not pending:
        return {}
    t0 = time.perf_counter()
    version = D.broadcast_object(engine.weight_version if D.global_rank() == 0 else None, 0)
    opt = options or SyncOptions()
    meter = MemoryMeter()
    mode = D.broadcast_object(engine.sync_mode_seen if D.global_rank() == 0 else None, 0)
    if mode == "nccl":
        out = sync_weights(policy, engine, version, "nccl", opt)
    else:
        from mcore_rl.policy.hf_weights import iter_hf_tensors

        stream = iter_hf_tensors(
            policy.model, policy.family, policy.args, 0, int(opt.bucket_mb * 2**20), meter
        )
        if D.global_rank() == 0:
            engine.update_weights(stream, version, urls=pending)
        else:
            for _ in stream:
                pass
        out = {}
    if D.global_rank() == 0:
        engine.mark_resynced(pending)
    return {**out, "resync_s": time.perf_counter() - t0, "resync_servers": float(len(pending))}
