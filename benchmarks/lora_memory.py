"""LoRA vs full-weight training of the same model: trainable parameters, gradient-buffer and optimizer-state bytes,
peak RSS and step time, each mode in a fresh process (peak RSS is per process).

    python benchmarks/lora_memory.py [--model smollm2|tiny] [--rank 16] [--batch 4] [--seq 128] [--steps 3]

Both modes load the same HF weights in fp32 and run `--steps` optimizer steps on the same token batch; LoRA puts
rank `--rank` adapters on every linear (qkv, proj, fc1, fc2). Why RSS: on CPU every byte of weights, gradient
buffers, Adam moments and activations is host memory, so the peak RSS is the footprint a GPU run would see on the
device (plus the Python/torch baseline, which both modes share).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def child(mode: str, model: str, rank: int, batch: int, seq: int, steps: int) -> dict:
    import torch

    from mcore_rl.config.model import LoraConfig
    from mcore_rl.config.optim import OptimSettings
    from mcore_rl.distributed import init_distributed
    from mcore_rl.policy.lora import trainable_parameters
    from mcore_rl.policy.policy import Policy, PolicyConfig
    from mcore_rl.policy.step import PolicyBatch

    if model == "smollm2":
        from mcore_rl.models.smollm2 import materialize_smollm2

        hf = materialize_smollm2()
    else:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from tests.conftest import save_random_hf, tiny_llama_config

        hf = save_random_hf(__import__("tempfile").mkdtemp(), tiny_llama_config())
    init_distributed(1, 1)
    lora = LoraConfig(rank=rank, alpha=2.0 * rank) if mode == "lora" else LoraConfig()
    cfg = PolicyConfig(optim=OptimSettings(lr=1e-4, clip_grad=1.0), token_budget=batch * seq, lora=lora)
    cfg.build.dtype = "fp32"
    policy = Policy(hf, cfg)
    policy.load_hf(hf)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, policy.args.vocab_size, (batch, seq), generator=g)
    pb = PolicyBatch(tokens, torch.ones(batch, seq))
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        policy.zero_grad()
        policy.forward_backward(pb, lambda mb, lp, ent: (-(lp * mb.loss_mask).sum() / (batch * seq), {}))
        stats = policy.optimizer_step()
        times.append(time.perf_counter() - t)
    trainable, total = trainable_parameters(policy.model)
    grad_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in policy.model.buffers)
    opt_bytes = sum(
        t.numel() * t.element_size()
        for st in policy.optimizer.optimizer.state.values()
        for t in st.values()
        if torch.is_tensor(t)
    )
    return {
        "mode": mode,
        "rank": rank if mode == "lora" else 0,
        "params_total": total,
        "params_trainable": trainable,
        "grad_buffer_mb": grad_bytes / 2**20,
        "optimizer_state_mb": opt_bytes / 2**20,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_s": sorted(times)[len(times) // 2],
        "grad_norm": stats["grad_norm"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--child", default=None, choices=["full", "lora"])
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.model, a.rank, a.batch, a.seq, a.steps)))
        return
    rows = []
    for mode in ("full", "lora"):
        cmd = [sys.executable, __file__, "--child", mode, "--model", a.model, "--rank", str(a.rank),
               "--batch", str(a.batch), "--seq", str(a.seq), "--steps", str(a.steps)]  # fmt: skip
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    cols = ["mode", "rank", "params_total", "params_trainable", "grad_buffer_mb", "optimizer_state_mb",
            "peak_rss_mb", "step_s"]  # fmt: skip
    print(f"{a.model}, fp32, batch {a.batch} x {a.seq} tokens, {a.steps} steps (median step time)")
    print(" | ".join(f"{c:>18}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]:>18.2f}" if isinstance(r[c], float) else f"{r[c]:>18}" for c in cols))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
