"""Generate n samples per prompt of one held-out set, score them, summarize as mean@n and pass@k."""

from __future__ import annotations

import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mcore_rl.data import render_prompt
from mcore_rl.evaluation.passk import summarize_correct
from mcore_rl.evaluation.sets import EvalSet
from mcore_rl.rollout.protocol import GenerationRequest, SamplingParams


@dataclass
class GenerationConfig:
    n: int = 8
    temperature: float = 0.7
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 777  # prompt i uses seed + i (the trainer's convention): re-runs and checkpoints compare 1:1


@dataclass
class SetResult:
    spec: str
    name: str
    summary: dict[str, float]
    per_prompt: list[dict[str, Any]] = field(repr=False)


def _progress(futures: list[Future], desc: str, enabled: bool) -> None:
    """Block until every sample is done, ticking a bar as samples finish (the engine completes them out of
    order, so we count completions rather than walk the list)."""
    if not enabled:
        wait(futures)
        return
    from tqdm import tqdm

    with tqdm(total=len(futures), desc=desc, unit="sample", dynamic_ncols=True, leave=False) as bar:
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=1.0)
            if done:
                bar.update(len(done))


def evaluate_set(engine, tokenizer, eval_set: EvalSet, spec: str, gen: GenerationConfig, ks: list[int],
                 progress: bool = True) -> SetResult:
    stop_ids = [t for t in {tokenizer.eos_token_id} if t is not None]
    records = eval_set.records
    reqs = [GenerationRequest(prompt_ids=render_prompt(tokenizer, r), rid=f"eval-{i}",
                              sampling=SamplingParams(max_new_tokens=gen.max_new_tokens, temperature=gen.temperature,
                                                      top_p=gen.top_p, n=gen.n, seed=gen.seed + i,
                                                      stop_token_ids=stop_ids))
            for i, r in enumerate(records)]
    t0 = time.perf_counter()
    futures = engine.submit(reqs)
    _progress(futures, spec, progress)
    samples = [f.result() for f in futures]  # request-major: prompt i's samples are [i*n, (i+1)*n)
    t_gen = time.perf_counter() - t0
    texts = [s.text or "" for s in samples]
    correct = eval_set.scorer.correct(texts, [r for r in records for _ in range(gen.n)])
    matrix = np.asarray(correct, dtype=bool).reshape(len(records), gen.n)
    lengths = np.asarray([len(s.output_ids) for s in samples], dtype=np.float64)
    truncated = np.asarray([s.finish_reason == "length" for s in samples], dtype=np.float64)
    summary = summarize_correct(matrix, ks)
    summary.update({"response_len": float(lengths.mean()), "truncation_rate": float(truncated.mean()),
                    "time_generate_s": t_gen, "time_total_s": time.perf_counter() - t0,
                    "tokens_per_s": float(lengths.sum() / max(t_gen, 1e-9))})
    per_prompt = [{"prompt_id": r.prompt_id, "answer": r.answer, "correct": matrix[i].tolist(),
                   "responses": texts[i * gen.n:(i + 1) * gen.n]} for i, r in enumerate(records)]
    return SetResult(spec, eval_set.name, summary, per_prompt)
