"""Megatron policy fwd+bwd speed against the matmul roofline measured in the same run, and the step's peak memory
with the chunked LM head (`policy/chunked_head.py`) and without it, side by side.

    python benchmarks/policy_step.py [--model smollm2|tiny|llama-0.5b] [--batch 8] [--seq 64] [--iters 5]
        [--dtypes fp32,bf16,bf16-fp32gemm] [--heads chunked,unchunked] [--device cpu|cuda] [--no-hf] [--profile N]

Each (dtype, head) runs in its own process, so peak memory is that step's alone: on CPU the kernel's RSS
high-water mark (VmHWM, reset through /proc/self/clear_refs right before one step, after `malloc_trim` returned
the free heap pages, so the rise above the pre-step RSS is the step's own memory), on CUDA
`torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`. Per row: the roofline (best `torch.mm` rate
over this model's GEMM shapes at the micro-batch's token count, in the row's dtype, sampled right before each
timed step), the step's model FLOPs (6 x matmul params x tokens + causal attention), the achieved rate of a
Megatron fwd+bwd (median over --iters after a warm-up that also compiles) and its fraction of the roofline (MFU on
a GPU: the median and the best of the per-step fractions, each against the roofline sampled next to it), the
optimizer step, and
optionally `transformers` on the same weights and loss. The default 8 x 64 tokens is the main job's micro-batch
(`trainer.token_budget=512`); every token is scored, the largest LM-head load for that budget.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

from scratch import scratch_dir  # benchmarks/scratch.py (sys.path[0] is this folder)

SHAPES = {  # HF LlamaConfig kwargs for the random-weight models
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=8192),
    # Qwen2.5-0.5B-like Llama shape (GPU MFU runs)
    "llama-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}


def bench(fn, iters: int) -> float:
    """Median seconds per call after a warm-up."""
    fn()  # warm-up (and the compiled ops' compilation)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
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


def sustained_gflops(args, dtype, tokens: int, device: str, seconds: float = 0.2) -> float:
    """The model's GEMM shapes at `tokens` rows, each run back to back for `seconds`: total FLOPs over total time
    of the fastest shape. Sustained, not a best-of call: another process slows it as much as it slows a step (a
    best-of picks the gaps in the load and reads the quiet rate while the steps run at half of it)."""
    import torch

    h, best = args.hidden_size, 0.0
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for m, k, n in [(tokens, h, args.ffn_hidden_size), (tokens, args.ffn_hidden_size, h),
                    (tokens, h, args.num_attention_heads * args.head_dim)]:
        x, w = torch.randn(m, k, device=device).to(dtype), torch.randn(k, n, device=device).to(dtype)
        torch.mm(x, w)
        sync()
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(8):  # a GPU queues the 8 back to back (one sync per 8: a sync per call adds latency)
                torch.mm(x, w)
            sync()
            calls += 8
        best = max(best, 2.0 * m * k * n * calls / (time.perf_counter() - t0) / 1e9)
    return best


def paired(step, roofline, iters: int) -> tuple[list[float], list[float]]:
    """(seconds per step, sustained roofline GFLOP/s measured right before that step) for `iters` steps after a
    warm-up. Why paired: on a shared machine the load moves the achievable matmul rate by 2x within minutes, so one
    roofline measured apart from the steps gave fractions of 60% and 98% for two rows of one run; a step's
    fraction of a sustained roofline sampled next to it sees the same load."""
    step()  # warm-up (and the compiled ops' compilation)
    seconds, roofs = [], []
    for _ in range(iters):
        roofs.append(roofline())
        t = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - t)
    return seconds, roofs


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def step_peak_mb(torch, step, device: str) -> tuple[float, float]:
    """(peak, peak - before) in MB of one call of `step`: RSS high-water mark on CPU, allocator peak on CUDA."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        peak = torch.cuda.max_memory_allocated()
        return peak / 2**20, (peak - before) / 2**20
    from mcore_rl.compat.malloc import trim

    trim()  # free heap pages back to the OS: the pre-step RSS is the live set
    before = _status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    step()
    peak = _status_kb("VmHWM")
    return peak / 1024, (peak - before) / 1024


def measure(a, name: str, head: str) -> dict:
    """One (dtype, head) in this process: Megatron fwd+bwd, its peak memory, optimizer step, roofline, HF."""
    import torch

    from mcore_rl.models.spec import BuildConfig
    from mcore_rl.policy.policy import Policy, PolicyConfig
    from mcore_rl.policy.step import PolicyBatch

    n_tok = a.batch * a.seq
    from mcore_rl.trainer.setup import resolve_compile, resolve_head_compile

    # "bf16": the element-wise ops as the trainer builds them (model.compile=auto: compiled on CPU; on CUDA the
    # layers' ops eager and the LM head's log-prob kernels compiled);
    # "bf16-eager" / "bf16-compiled": forced either way (compat/fused_ops.py), for the side-by-side gain;
    # "bf16-fp32gemm": bf16 products through fp32 GEMMs (compat/bf16_matmul.py, model.bf16_matmul=fp32)
    base, _, mode = name.partition("-")
    tdt = {"fp32": torch.float32, "bf16": torch.bfloat16}[base]
    setting = {"": "auto", "eager": "false", "compiled": "true", "fp32gemm": "auto"}[mode]
    if mode == "fp32gemm":
        from mcore_rl.compat import bf16_matmul

        bf16_matmul.enable()
    build = BuildConfig(dtype=base, compile=resolve_compile(setting, cuda=a.device == "cuda"),
                        compile_head=resolve_head_compile(setting))
    policy = Policy(a.folder, PolicyConfig(build=build, token_budget=n_tok))
    policy.load_hf(a.folder)
    args = policy.args
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (a.batch, a.seq), generator=gen)
    mask = torch.ones_like(tokens, dtype=torch.float32)
    if a.ragged:  # RL-like rows: lengths uniform in [seq/4, seq], right padded
        lengths = torch.randint(a.seq // 4, a.seq + 1, (a.batch,), generator=gen)
        mask = (torch.arange(a.seq).unsqueeze(0) < lengths.unsqueeze(1)).float()
    batch = PolicyBatch(tokens, mask)
    n_real = int(mask.sum())
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    from mcore_rl.policy.step import run_forward_backward

    def megatron_step():
        policy.model.zero_grad_buffer()
        policy.model.train()
        run_forward_backward(policy.model, policy.micro_batches(batch), args.vocab_size,
                             lambda mb, logp, ent: (-(logp * mb.loss_mask).sum() / n_tok, {}),
                             chunked_head=head != "unchunked", packed=head == "packed")
        sync()

    flops = model_flops_per_token(args, a.seq) * n_real  # real tokens only: pad tokens are not useful work
    steps, roofs = paired(megatron_step, lambda: sustained_gflops(args, tdt, n_tok, a.device), a.iters)
    peak, step_mb = step_peak_mb(torch, megatron_step, a.device)
    t_o = bench(policy.optimizer.step, max(1, a.iters // 2))
    t_m = statistics.median(steps)
    achieved = flops / t_m / 1e9
    fracs = [flops / t / 1e9 / r for t, r in zip(steps, roofs)]
    row = dict(dtype=name, head=head, tok_s=n_real / t_m, gflops=achieved, roof=max(roofs),
               frac=statistics.median(fracs), best_frac=max(fracs), opt=t_o, step_flops=flops, peak_mb=peak,
               step_mb=step_mb)
    if not a.no_hf and head == "chunked" and not a.ragged:
        row.update(hf_step(torch, a, tdt, tokens, n_tok, flops, sync))
    if a.profile:
        print_profile(torch, megatron_step, a.device, a.profile, f"{name}:{head}")
    return row


def print_profile(torch, step, device: str, top: int, label: str) -> None:
    """The ops of one step by self time on the device that runs them (CUDA kernels on a GPU), so the share of
    the step that is not GEMM work is visible. Lines go out prefixed `PROF|` for the parent to print."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        step()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=70)
    print("\n".join(f"PROF|{label}| {line}" for line in table.splitlines()), flush=True)


def hf_step(torch, a, tdt, tokens, n_tok: int, flops: float, sync) -> dict:
    """transformers on the same weights and loss (pure weights in the dtype, fp32 log-softmax)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(a.folder, dtype=tdt).to(a.device)
    hf.train()
    tok_d = tokens.to(a.device)

    def step():
        hf.zero_grad(set_to_none=True)
        logits = hf(tok_d).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, tok_d[:, 1:, None]).squeeze(-1)
        (-(logp.sum()) / n_tok).backward()
        sync()

    t_h = bench(step, a.iters)
    return dict(hf_tok_s=n_tok / t_h, hf_gflops=flops / t_h / 1e9)  # HF: unpadded rows only (no --ragged)


def interleaved(a, name: str, heads: list[str]) -> None:
    """Every head in ONE process, steps alternated (A, B, A, B, ...): on a loaded machine the load drifts between
    processes, so speed ratios are read from this, peak memory from the per-process rows."""
    import torch

    from mcore_rl.models.spec import BuildConfig
    from mcore_rl.policy.policy import Policy, PolicyConfig
    from mcore_rl.policy.step import PolicyBatch, run_forward_backward

    n_tok = a.batch * a.seq
    policy = Policy(a.folder, PolicyConfig(build=BuildConfig(dtype=name), token_budget=n_tok))
    policy.load_hf(a.folder)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, policy.args.vocab_size, (a.batch, a.seq), generator=gen)
    mask = torch.ones_like(tokens, dtype=torch.float32)
    if a.ragged:
        lengths = torch.randint(a.seq // 4, a.seq + 1, (a.batch,), generator=gen)
        mask = (torch.arange(a.seq).unsqueeze(0) < lengths.unsqueeze(1)).float()
    batch = PolicyBatch(tokens, mask)
    times: dict[str, list[float]] = {h: [] for h in heads}
    for it in range(a.iters + 1):  # the first round warms up (and compiles)
        for head in heads:
            policy.model.zero_grad_buffer()
            t = time.perf_counter()
            run_forward_backward(policy.model, policy.micro_batches(batch), policy.args.vocab_size,
                                 lambda mb, logp, ent: (-(logp * mb.loss_mask).sum() / n_tok, {}),
                                 chunked_head=head != "unchunked", packed=head == "packed")
            if it:
                times[head].append(time.perf_counter() - t)
    med = {h: statistics.median(v) for h, v in times.items()}
    print(f"interleaved {name}, {a.iters} rounds: " + ", ".join(f"{h} {med[h]:.2f} s/step" for h in heads)
          + "; step time vs " + heads[0] + ": " + ", ".join(f"{h} {med[h] / med[heads[0]]:.2f}x" for h in heads[1:])
          + f" (per round {heads[1]}/{heads[0]}: "
          + ", ".join(f"{times[heads[1]][i] / times[heads[0]][i]:.2f}" for i in range(a.iters)) + ")")


def child(a) -> None:
    from mcore_rl.compat.malloc import tune_malloc

    tune_malloc()  # before torch starts threads
    from mcore_rl.distributed import init_distributed

    init_distributed(1, 1)
    name, head = a.child.split(":")
    if head == "interleave":
        return interleaved(a, name, a.heads.split(","))
    print("ROW " + json.dumps(measure(a, name, head)), flush=True)


def child_cmd(a, name: str, head: str) -> list[str]:
    return [sys.executable, __file__, "--child", f"{name}:{head}", "--folder", a.folder, "--batch", str(a.batch),
           "--seq", str(a.seq), "--iters", str(a.iters), "--device", a.device] + (["--no-hf"] if a.no_hf else []) + (
           ["--ragged"] if a.ragged else []) + ["--heads", a.heads, "--profile", str(a.profile)]


def run_child(a, name: str, head: str) -> dict:
    proc = subprocess.run(child_cmd(a, name, head), capture_output=True, text=True)
    rows = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    for line in proc.stdout.splitlines():
        if line.startswith("PROF|"):
            print(line[5:])
    if proc.returncode != 0 or not rows:
        raise SystemExit(f"{name}:{head} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(rows[0])


def print_table(rows: list[dict], device: str) -> None:
    mem = "peak alloc MB" if device == "cuda" else "peak RSS MB"
    print(f"{'dtype':>10} | {'head':>9} | {'fwd+bwd tok/s':>13} | {'step GFLOP':>10} | {'GFLOP/s':>8} | "
          f"{'matmul roofline':>15} | {'% roofline':>10} | {'best-of %':>9} | {mem:>13} | {'step +MB':>8} | "
          f"{'optim s':>7} | {'HF tok/s':>8}")
    for r in rows:
        hf_t = f"{r['hf_tok_s']:8,.0f}" if "hf_tok_s" in r else f"{'-':>8}"
        print(f"{r['dtype']:>10} | {r['head']:>9} | {r['tok_s']:13,.0f} | {r['step_flops'] / 1e9:10,.0f} | "
              f"{r['gflops']:8,.1f} | {r['roof']:15,.1f} | {100 * r['frac']:9.1f}% | {100 * r['best_frac']:8.1f}% | "
              f"{r['peak_mb']:13,.0f} | {r['step_mb']:8,.0f} | {r['opt']:7.3f} | {hf_t}")
    by = {(r["dtype"], r["head"]): r for r in rows}
    for dt in dict.fromkeys(r["dtype"] for r in rows):
        c, u = by.get((dt, "chunked")), by.get((dt, "unchunked"))
        if c and u:
            print(f"{dt}: chunked head: step peak {u['step_mb']:,.0f} -> {c['step_mb']:,.0f} MB above the "
                  f"pre-step {'allocation' if device == 'cuda' else 'RSS'} ({u['peak_mb']:,.0f} -> "
                  f"{c['peak_mb']:,.0f} MB peak), fwd+bwd {c['tok_s'] / u['tok_s']:.2f}x the unchunked speed")
    heads = {(r["dtype"]): r for r in rows if r["head"] == "chunked"}
    if "fp32" in heads and "bf16" in heads:
        print(f"bf16/fp32 speed-up: fwd+bwd {heads['bf16']['tok_s'] / heads['fp32']['tok_s']:.2f}x, "
              f"roofline {heads['bf16']['roof'] / heads['fp32']['roof']:.2f}x")
    for other in ("bf16", "fp32"):
        if "bf16-fp32gemm" in heads and other in heads:
            print(f"bf16 via fp32 GEMMs / {other}: fwd+bwd {heads['bf16-fp32gemm']['tok_s'] / heads[other]['tok_s']:.2f}x")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", *SHAPES])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--dtypes", default="fp32", help="comma list of fp32, bf16, bf16-eager, bf16-compiled, bf16-fp32gemm")
    ap.add_argument("--heads", default="chunked,unchunked",
                    help="comma list of chunked, unchunked (both padded rows), packed (chunked, rows packed)")
    ap.add_argument("--ragged", action="store_true", help="rows of random lengths (padding), as RL batches")
    ap.add_argument("--interleave", action="store_true", help="speed ratio of --heads, alternated in one process")
    ap.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda where available")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers side (large models)")
    ap.add_argument("--profile", type=int, default=0, help="print the N ops with the most self time of one step")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    return ap.parse_args()


def main() -> None:
    a = parse()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.child:
        return child(a)
    import torch

    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.model == "smollm2":
        from mcore_rl.models.smollm2 import materialize_smollm2

        a.folder = str(materialize_smollm2())
    else:
        from transformers import AutoModelForCausalLM, LlamaConfig

        a.folder = str(scratch_dir("policy_step_"))
        AutoModelForCausalLM.from_config(LlamaConfig(**SHAPES[a.model])).save_pretrained(a.folder)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    gpu = torch.cuda.get_device_name() if a.device == "cuda" else "-"
    print(f"model={a.model} batch={a.batch} seq={a.seq} tokens={a.batch * a.seq} threads={torch.get_num_threads()} "
          f"device={a.device} cpu={cpu!r} gpu={gpu!r} load={os.getloadavg()[0]:.2f}", flush=True)
    if a.interleave:  # speed ratios only, one process, heads alternated
        for name in a.dtypes.split(","):
            print(subprocess.run(child_cmd(a, name, "interleave"), capture_output=True, text=True).stdout.strip())
        return
    rows = [run_child(a, name, head) for name in a.dtypes.split(",") for head in a.heads.split(",")]
    print_table(rows, a.device)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
