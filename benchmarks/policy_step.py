"""Megatron policy fwd+bwd speed against the matmul roofline measured in the same run, fp32 and bf16, with a
`transformers` model of the same weights side by side.

    python benchmarks/policy_step.py [--model smollm2|tiny] [--batch 4] [--seq 256] [--iters 5] [--dtypes fp32,bf16]

For each dtype: the roofline is the best `torch.mm` rate over transformer-sized shapes of this model (the same GEMMs
the layers run); the achieved rate is model FLOPs (6 x matmul params x tokens + causal attention) per second of a
Megatron fwd+bwd; their ratio is the fraction of the roofline reached (MFU on a GPU). The transformers model runs
in the same dtype (pure bf16 weights, fp32 log-softmax) and computes the same loss, so the ratio compares
implementations. Medians over --iters after a warm-up; the roofline is a best-of (other processes only slow it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from scratch import scratch_dir  # benchmarks/scratch.py (sys.path[0] is this folder)


def bench(fn, iters: int, best: list | None = None) -> float:
    """Median seconds per call after a warm-up; appends the fastest call to `best` when given."""
    fn()  # warm-up
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    if best is not None:
        best.append(min(times))
    return statistics.median(times)


def model_flops_per_token(args, seq: int) -> float:
    """fwd+bwd FLOPs per token: 3 x (2 x matmul params + causal attention scores/values)."""
    h, f, L = args.hidden_size, args.ffn_hidden_size, args.num_layers
    q = args.num_attention_heads * args.head_dim
    kv = args.num_query_groups * args.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * f
    matmul_params = L * per_layer + args.vocab_size * h
    attn = L * 2 * q * seq  # QK^T and AV, causal: on average seq/2 keys, 2 matmuls x 2 FLOPs
    return 3 * (2 * matmul_params + attn)


def roofline_gflops(torch, args, dtype, tokens: int, device: str) -> float:
    from mcore_rl.policy.precision import matmul_gflops

    h = args.hidden_size
    shapes = [(tokens, h, args.ffn_hidden_size), (tokens, args.ffn_hidden_size, h),
              (tokens, h, args.num_attention_heads * args.head_dim)]
    return max(matmul_gflops(dtype, m, k, n, min_time=0.3, device=device) for m, k, n in shapes)


def measure(torch, a, folder: str, name: str, device: str) -> dict:
    """One dtype: Megatron fwd+bwd and optimizer step, the matmul roofline, and transformers' fwd+bwd."""
    from transformers import AutoModelForCausalLM

    from mcore_rl.models.spec import BuildConfig
    from mcore_rl.policy.policy import Policy, PolicyConfig
    from mcore_rl.policy.step import PolicyBatch

    n_tok = a.batch * a.seq
    # "bf16-eager": bf16 with the compiled element-wise ops off (compat/fused_ops.py), for the side-by-side gain
    tdt = {"fp32": torch.float32, "bf16": torch.bfloat16}[name.removesuffix("-eager")]
    build = BuildConfig(dtype=name.removesuffix("-eager"), compile=not name.endswith("-eager"))
    policy = Policy(folder, PolicyConfig(build=build, token_budget=n_tok))
    policy.load_hf(folder)
    args = policy.args
    tokens = torch.randint(0, args.vocab_size, (a.batch, a.seq), generator=torch.Generator().manual_seed(0))
    batch = PolicyBatch(tokens, torch.ones_like(tokens, dtype=torch.float32))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def megatron_step():
        policy.model.zero_grad_buffer()
        policy.forward_backward(batch, lambda mb, logp, ent: (-(logp * mb.loss_mask).sum() / n_tok, {}))
        sync()

    fastest: list[float] = []
    t_m = bench(megatron_step, a.iters, fastest)
    t_o = bench(policy.optimizer.step, max(1, a.iters // 2))
    roof = roofline_gflops(torch, args, tdt, n_tok, device)
    flops = model_flops_per_token(args, a.seq) * n_tok
    achieved = flops / t_m / 1e9
    # best-of fraction: the roofline is a best-of, so under load compare it with the fastest step too
    row = dict(dtype=name, tok_s=n_tok / t_m, gflops=achieved, roof=roof, frac=achieved / roof, opt=t_o,
               best_frac=flops / fastest[0] / 1e9 / roof)
    if a.no_hf:
        return row
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=tdt).to(device)
    hf.train()
    tok_d = tokens.to(device)

    def hf_step():
        hf.zero_grad(set_to_none=True)
        logits = hf(tok_d).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, tok_d[:, 1:, None]).squeeze(-1)
        (-(logp.sum()) / n_tok).backward()
        sync()

    t_h = bench(hf_step, a.iters)
    row.update(hf_tok_s=n_tok / t_h, hf_gflops=flops / t_h / 1e9)
    return row


def main() -> None:
    from mcore_rl.compat.malloc import tune_malloc

    tune_malloc()  # before torch starts threads
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny", "llama-0.5b"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, bf16, bf16-eager")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers side (large models)")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, LlamaConfig

    if a.model == "smollm2":
        from mcore_rl.models.smollm2 import materialize_smollm2

        folder = str(materialize_smollm2())
    else:
        shape = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=8192)
        if a.model == "llama-0.5b":  # Qwen2.5-0.5B-like Llama shape, random weights (GPU MFU runs)
            shape = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
        folder = str(scratch_dir("policy_step_"))
        AutoModelForCausalLM.from_config(LlamaConfig(**shape)).save_pretrained(folder)

    from mcore_rl.distributed import init_distributed

    init_distributed(1, 1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"model={a.model} batch={a.batch} seq={a.seq} threads={torch.get_num_threads()} device={device} "
          f"load={os.getloadavg()[0]:.2f}")
    rows = [measure(torch, a, folder, name, device) for name in a.dtypes.split(",")]
    print(f"{'dtype':>10} | {'fwd+bwd tok/s':>13} | {'GFLOP/s':>8} | {'matmul roofline':>15} | {'% roofline':>10} | "
          f"{'best-of %':>9} | {'optimizer step s':>16} | {'transformers tok/s':>18} | {'ratio ours/HF':>13}")
    for r in rows:
        hf_t = f"{r['hf_tok_s']:18,.0f}" if "hf_tok_s" in r else f"{'-':>18}"
        ratio = f"{r['tok_s'] / r['hf_tok_s']:13.2f}" if "hf_tok_s" in r else f"{'-':>13}"
        print(f"{r['dtype']:>10} | {r['tok_s']:13,.0f} | {r['gflops']:8,.0f} | {r['roof']:15,.0f} | "
              f"{100 * r['frac']:9.1f}% | {100 * r['best_frac']:8.1f}% | {r['opt']:16.3f} | {hf_t} | {ratio}")
    by = {r["dtype"]: r for r in rows}
    if "fp32" in by and "bf16" in by:
        print(f"bf16/fp32 speed-up: fwd+bwd {by['bf16']['tok_s'] / by['fp32']['tok_s']:.2f}x, "
              f"roofline {by['bf16']['roof'] / by['fp32']['roof']:.2f}x")
    if "bf16-eager" in by and "bf16" in by:
        print(f"compiled element-wise ops: bf16 fwd+bwd {by['bf16']['tok_s'] / by['bf16-eager']['tok_s']:.2f}x "
              f"faster than bf16-eager")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
