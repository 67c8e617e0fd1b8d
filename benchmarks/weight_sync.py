"""Weight sync (Megatron policy -> embedded engine) GB/s vs a plain memcpy of the same bytes, in one run.

    python benchmarks/weight_sync.py [--model smollm2|tiny] [--repeats 3] [--mode tensor|disk] [--bucket-mb 512]

The sync path gathers every tensor through the model adapter (QKV / gate-up split, HF names) and copies it into the
engine's parameters; the baseline copies the same tensors into preallocated buffers.
"""

from __future__ import annotations

import argparse
import statistics
import time

from scratch import scratch_dir  # benchmarks/scratch.py (sys.path[0] is this folder)


def main() -> None:
    from mcore_rl.compat.malloc import tune_malloc

    tune_malloc()
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mode", default="tensor", choices=["tensor", "disk"])
    ap.add_argument("--bucket-mb", type=float, default=512.0)
    a = ap.parse_args()
    if a.model == "smollm2":
        from mcore_rl.models.smollm2 import materialize_smollm2

        folder = materialize_smollm2()
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        folder = str(scratch_dir("weight_sync_model_"))
        LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     vocab_size=8192)).save_pretrained(folder)
    from mcore_rl.distributed import init_distributed
    from mcore_rl.policy.policy import Policy, PolicyConfig
    from mcore_rl.rollout.local.engine import LocalEngine
    from mcore_rl.rollout.weight_sync.megatron_sync import sync_weights
    from mcore_rl.rollout.weight_sync.transports import SyncOptions

    init_distributed(1, 1)
    policy = Policy(folder, PolicyConfig(), trainable=False)
    policy.load_hf(folder)
    engine = LocalEngine(str(folder))
    sync_dir = str(scratch_dir("weight_sync_"))
    sync_t, gb, peak = [], 0.0, {}
    for v in range(a.repeats):
        st = sync_weights(policy, engine, version=v + 1, mode=a.mode,
                          options=SyncOptions(sync_dir=sync_dir, config_dir=folder, bucket_mb=a.bucket_mb))
        sync_t.append(st["sync_s"])
        gb = st["sync_gb"]
        peak = {k: st[k] for k in ("sync_peak_extra_mb", "sync_bound_mb")}
    tensors = [t.clone() for _, t in policy.hf_tensors()]
    bufs = [torch.empty_like(t) for t in tensors]
    copy_t = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        for b, t in zip(bufs, tensors):
            b.copy_(t)
        copy_t.append(time.perf_counter() - t0)
    engine.close()
    s, c = statistics.median(sync_t), statistics.median(copy_t)
    print(f"model={a.model} mode={a.mode} bytes={gb:.3f} GB")
    print(f"weight sync: {gb / s:.2f} GB/s (median {s:.3f} s)")
    print(f"memcpy     : {gb / c:.2f} GB/s (median {c:.3f} s)")
    print(f"ratio sync/memcpy: {c / s:.2f}")
    print(f"peak extra memory of the stream: {peak['sync_peak_extra_mb']:.1f} MB (bound: one bucket + one "
          f"parameter = {peak['sync_bound_mb']:.1f} MB; model {gb * 1e9 / 2**20:.1f} MB)")


if __name__ == "__main__":
    main()
