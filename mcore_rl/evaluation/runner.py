"""Held-out evaluation, the one implementation behind both `mcore-rl-eval` and the trainer's periodic eval: generate
n samples per prompt of a set (prompt i sampled with seed + i), score them, summarize as mean@n and unbiased pass@k.

Why one implementation: a run's logged held-out numbers and `mcore-rl-eval` on the same weights must be the same
numbers (tests/evaluation/test_train_eval_sets.py), which only holds if requests, seeds and scoring are one code.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mcore_rl.evaluation.passk import summarize_correct
from mcore_rl.evaluation.scorers import RewardScorer, Scorer
from mcore_rl.rollout.protocol import GenerationRequest, RolloutEngine, Sample, SamplingParams


@dataclass
class GenerationConfig:
    n: int = 8
    temperature: float = 0.7
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 777  # prompt i uses seed + i: re-runs, checkpoints and the trainer's evals compare 1:1


@dataclass
class HeldOutSet:
    """One held-out set, ready to generate: rendered prompts, their records (.answer, .prompt_id) and a scorer
    (None = the reward passed to `evaluate_sets` decides, via its `correct` field)."""

    name: str  # metric prefix
    prompts: list[list[int]]
    records: list
    scorer: Scorer | None = None
    prefixed: bool = True  # False only for the trainer's implicit default set (its keys are unprefixed)


@dataclass
class SetResult:
    spec: str
    name: str
    summary: dict[str, float]
    per_prompt: list[dict[str, Any]] = field(repr=False)
    correct: np.ndarray = field(repr=False)  # [prompts, n] bool


def _progress(engine: RolloutEngine, futures: list[Future], desc: str) -> None:
    """Block until every sample is done, ticking a bar as samples finish (the engine completes them out of
    order, so we count completions rather than walk the list). Waits through the engine, which may decode on
    this thread meanwhile."""
    from tqdm import tqdm

    with tqdm(total=len(futures), desc=desc, unit="sample", dynamic_ncols=True, leave=False) as bar:
        pending = list(futures)
        while pending:
            engine.wait(pending, timeout=1.0)
            left = [f for f in pending if not f.done()]
            bar.update(len(pending) - len(left))
            pending = left


def _generate(engine: RolloutEngine, reqs: list[GenerationRequest], progress: str | None) -> list[Sample]:
    """Request-major samples: prompt i's n samples are [i*n, (i+1)*n)."""
    if progress is None:
        return engine.generate(reqs)
    futures = engine.submit(reqs)
    _progress(engine, futures, progress)
    return [f.result() for f in futures]


def evaluate_set(engine: RolloutEngine, hs: HeldOutSet, gen: GenerationConfig, stop_token_ids: list[int],
                 ks: list[int] | None = None, spec: str = "", progress: bool = False) -> SetResult:
    """Sample, score and summarize one set. `ks`: the pass@k to report (default 1..n); `progress`: a bar."""
    if hs.scorer is None:
        raise ValueError(f"held-out set {hs.name!r} has no scorer")
    tag = f"eval-{hs.name}-" if hs.prefixed else "eval-"
    sampling = dict(max_new_tokens=gen.max_new_tokens, temperature=gen.temperature, top_p=gen.top_p, n=gen.n,
                    stop_token_ids=list(stop_token_ids))
    reqs = [GenerationRequest(prompt_ids=p, rid=f"{tag}{i}", sampling=SamplingParams(seed=gen.seed + i, **sampling))
            for i, p in enumerate(hs.prompts)]
    t0 = time.perf_counter()
    samples = _generate(engine, reqs, (spec or hs.name) if progress else None)
    t_gen = time.perf_counter() - t0
    texts = [s.text or "" for s in samples]
    ok = hs.scorer.correct(texts, [r for r in hs.records for _ in range(gen.n)])
    matrix = np.asarray(ok, dtype=bool).reshape(len(hs.prompts), gen.n)
    lengths = np.asarray([len(s.output_ids) for s in samples], dtype=np.float64)
    truncated = np.asarray([s.finish_reason == "length" for s in samples], dtype=np.float64)
    summary = summarize_correct(matrix, ks)
    summary.update({"response_len": float(lengths.mean()), "truncation_rate": float(truncated.mean()),
                    "time_generate_s": t_gen, "time_total_s": time.perf_counter() - t0,
                    "tokens_per_s": float(lengths.sum() / max(t_gen, 1e-9)), **hs.scorer.reward_means()})
    per_prompt = [{"prompt_id": r.prompt_id, "answer": r.answer, "correct": matrix[i].tolist(),
                   "responses": texts[i * gen.n:(i + 1) * gen.n]} for i, r in enumerate(hs.records)]
    return SetResult(spec or hs.name, hs.name, summary, per_prompt, matrix)


def _trainer_metrics(r: SetResult, k: int) -> dict[str, Any]:
    """The keys a run logs per set: mean@k / pass@k at k = n, every pass@j, and the per-prompt fractions."""
    s = r.summary
    return {
        "mean_at_k": s["mean_at_n"],
        "pass_at_k": s[f"pass_at_{k}"],  # pass@k at k = n: "any of the k samples correct"
        **{key: v for key, v in s.items() if key.startswith("pass_at_")},
        "k": float(k),
        "num_prompts": s["num_prompts"],
        "response_len": s["response_len"],
        "truncation_rate": s["truncation_rate"],
        **{key: v for key, v in s.items() if key.startswith("reward")},  # reward_mean, reward/<key>
        # per-prompt fraction correct (a list, not a metric: the trainer writes it to eval_prompts.jsonl) so that
        # experiments can bootstrap over held-out prompts as well as seeds
        "per_prompt_correct": r.correct.mean(1).tolist(),
    }


def evaluate_sets(engine: RolloutEngine, reward_fn, sets: list[HeldOutSet], k: int, temperature: float,
                  max_new_tokens: int, seed: int, stop_token_ids: list[int]) -> dict[str, Any]:
    """The trainer's periodic eval (rank 0 only): every set through `evaluate_set` with the same per-prompt
    seeds `mcore-rl-eval` uses, so two evaluations differ only by the weights. Each set's numbers are keyed
    `<name>/...`; the first set's also without a prefix (what the progress bar, the end-of-run summary and
    `mcore-rl-scaling fit --metric mean_at_k` read). A set without a scorer is scored by `reward_fn`."""
    gen = GenerationConfig(n=k, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    out: dict[str, Any] = {}
    for i, hs in enumerate(sets):
        if hs.scorer is None:
            hs = HeldOutSet(hs.name, hs.prompts, hs.records, RewardScorer(reward_fn), hs.prefixed)
        m = _trainer_metrics(evaluate_set(engine, hs, gen, stop_token_ids), k)
        if i == 0:
            out.update(m)
        if hs.prefixed:
            out.update({f"{hs.name}/{key}": v for key, v in m.items()})
    return out
