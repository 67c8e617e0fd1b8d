"""Local rollout engine vs plain `transformers.generate`, same model, prompts and sampling, side by side.

    python benchmarks/rollout_engine.py [--prompts 16] [--new-tokens 48] [--temperature 0.7] [--repeats 2]
    python benchmarks/rollout_engine.py --compare-decode --dtype bfloat16 --prompts 32 --ignore-eos

Runs are interleaved (HF, engine, HF, engine, ...) so machine noise hits both alike; prints tokens/s of each
run, the best of each, and their ratio. Tokens counted: generated tokens up to and including EOS.
`--compare-decode`: instead of HF, the engine's plain sampling path (boolean-indexed [B, V] copies) against the
index-free one (token_sampler.py), same engine and weights, switched between runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build_prompts(tokenizer, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        a, b = (7 * i + 3) % 21, (5 * i + 11) % 21
        msg = [{"role": "user", "content": f"What is {a} + {b}? Answer with just the number."}]
        ids = tokenizer.apply_chat_template(msg, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return prompts


def run_hf(
    model,
    tokenizer,
    prompts: list[list[int]],
    new_tokens: int,
    temperature: float,
    eos: int,
    ignore_eos: bool,
) -> int:
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)  # a CUDA model takes CUDA inputs
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=True,
            temperature=temperature,
            top_p=1.0,
            top_k=0,
            eos_token_id=eos,
            pad_token_id=pad,
            min_new_tokens=new_tokens if ignore_eos else 0,
        )
    if ignore_eos:
        return out[:, width:].cpu().numel()  # .cpu(): the timing includes the GPU's queued work
    return sum(row.index(eos) + 1 if eos in row else len(row) for row in out[:, width:].tolist())


def run_engine(
    engine, prompts: list[list[int]], new_tokens: int, temperature: float, ignore_eos: bool
) -> int:
    from mcore_rl.rollout.protocol import GenerationRequest, SamplingParams

    sp = SamplingParams(max_new_tokens=new_tokens, temperature=temperature, ignore_eos=ignore_eos)
    samples = engine.generate([GenerationRequest(p, sp) for p in prompts])
    return sum(s.num_output_tokens for s in samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model-path", default=None, help="HF folder (default: materialised SmolLM2-135M-Instruct)"
    )
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for both")
    ap.add_argument(
        "--ignore-eos", action="store_true", help="fixed-length outputs: raw per-step speed, no early exits"
    )
    ap.add_argument("--dtype", default="float32", help="engine (and HF) dtype: float32 | bfloat16")
    ap.add_argument(
        "--compare-decode", action="store_true", help="engine plain vs fast decode path instead of HF vs engine"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from mcore_rl.rollout.local.engine import LocalEngine

    path = args.model_path
    if path is None:
        from mcore_rl.models.smollm2 import materialize_smollm2

        path = str(materialize_smollm2())
    engine = LocalEngine(path, max_batch_size=max(64, args.prompts), dtype=args.dtype)
    model, tokenizer = engine.model, engine.tokenizer  # same weights for both: one copy in memory
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    eos = eos if eos is not None else tokenizer.eos_token_id
    prompts = build_prompts(tokenizer, args.prompts)
    print(
        f"model={path} prompts={len(prompts)} new_tokens={args.new_tokens} T={args.temperature} "
        f"threads={torch.get_num_threads()} ignore_eos={args.ignore_eos} dtype={args.dtype}"
    )

    def timed(name: str) -> int:
        if name == "hf_generate":
            return run_hf(model, tokenizer, prompts, args.new_tokens, args.temperature, eos, args.ignore_eos)
        engine.set_fast_decode(name == "engine_fast")
        return run_engine(engine, prompts, args.new_tokens, args.temperature, args.ignore_eos)

    names = ("engine_plain", "engine_fast") if args.compare_decode else ("hf_generate", "engine_fast")
    # warm-up (allocators, kernels) for both, not timed
    for name in names:
        if name == "hf_generate":
            run_hf(model, tokenizer, prompts[:2], 4, args.temperature, eos, args.ignore_eos)
        else:
            engine.set_fast_decode(name == "engine_fast")
            run_engine(engine, prompts[:2], 4, args.temperature, args.ignore_eos)

    # wall-clock tokens/s, and tokens per CPU-second of this process: on a shared machine the second one is the
    # steadier measure of the work a variant does (with --threads 1 it excludes time spent waiting for a core)
    rates: dict[str, list[float]] = {name: [] for name in names}
    cpu_rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.repeats):
        for name in names:
            t0, c0 = time.perf_counter(), time.process_time()
            n = timed(name)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            rates[name].append(n / dt)
            cpu_rates[name].append(n / dc)
            print(f"  run {r} {name:13s} {n:5d} tokens in {dt:6.2f} s = {n / dt:7.1f} tok/s  ({n / dc:7.1f} tok/cpu-s)")
    a, b = names
    for label, table in (("tok/s", rates), ("tok/cpu-s", cpu_rates)):
        best = {name: max(v) for name, v in table.items()}
        med = {name: statistics.median(v) for name, v in table.items()}
        for name in names:
            print(f"{name:13s} best {best[name]:7.1f} {label}  (median {med[name]:.1f})")
        print(f"ratio {b} / {a} in {label}: {best[b] / best[a]:.2f}x best, {med[b] / med[a]:.2f}x median")
    print(f"load average {os.getloadavg()[0]:.2f} (machine: {os.cpu_count()} cores)")
    engine.close()


if __name__ == "__main__":
    main()
