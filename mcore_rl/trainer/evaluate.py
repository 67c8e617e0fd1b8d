"""Held-out evaluation: the same fixed prompts every time, k samples each -> mean@k and pass@1..k (the unbiased
estimator shared with `mcore-rl-eval`, mcore_rl/evaluation/passk.py).

Several sets (`eval.sets`, the `mcore-rl-eval --set` grammar, loaded by mcore_rl/evaluation/sets.py): each set's
numbers are logged under `<name>/...`; the first set's are also logged without a prefix, which is what the progress
bar, the end-of-run summary and `mcore-rl-scaling fit --metric mean_at_k` read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_rl.evaluation.passk import summarize_correct
from mcore_rl.rollout.protocol import GenerationRequest, SamplingParams


@dataclass
class HeldOutSet:
    """One held-out set, ready to generate: `scorer` None = the trainer's reward decides correctness."""

    name: str  # metric prefix
    prompts: list[list[int]]
    records: list  # PromptRecord-like (.answer, .prompt_id), one per prompt
    scorer: object | None = None
    prefixed: bool = True  # False only for the implicit default set (records keep their historical keys)


def _correct(reward_fn, scorer, texts: list[str], records: list, k: int) -> list[bool]:
    expanded = [r for r in records for _ in range(k)]
    if scorer is not None:
        return scorer.correct(texts, expanded)
    return [bool(r.correct) for r in reward_fn.score(texts, [r.answer for r in expanded])]


def _evaluate_one(engine, reward_fn, hs: HeldOutSet, k: int, temperature: float, max_new_tokens: int, seed: int,
                  stop_token_ids: list[int]) -> dict[str, float]:
    tag = f"eval-{hs.name}-" if hs.prefixed else "eval-"
    reqs = [GenerationRequest(prompt_ids=p, rid=f"{tag}{i}",
                              sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, n=k,
                                                      seed=seed + i, stop_token_ids=stop_token_ids))
            for i, p in enumerate(hs.prompts)]
    samples = engine.generate(reqs)
    ok = _correct(reward_fn, hs.scorer, [s.text or "" for s in samples], hs.records, k)
    correct = torch.tensor(ok, dtype=torch.bool).view(len(hs.prompts), k)
    lengths = torch.tensor([float(len(s.output_ids)) for s in samples])
    summary = summarize_correct(correct.numpy())
    return {
        "mean_at_k": summary["mean_at_n"],
        "pass_at_k": summary[f"pass_at_{k}"],  # pass@k at k = n: "any of the k samples correct"
        **{key: v for key, v in summary.items() if key.startswith("pass_at_")},
        "k": float(k),
        "num_prompts": float(len(hs.prompts)),
        "response_len": lengths.mean().item(),
        # per-prompt fraction correct (a list: not a metric; run.py writes it to eval_prompts.jsonl) so that
        # experiments can bootstrap over held-out prompts as well as seeds
        "per_prompt_correct": correct.float().mean(1).tolist(),
    }


def evaluate_sets(engine, reward_fn, sets: list[HeldOutSet], k: int, temperature: float, max_new_tokens: int,
                  seed: int, stop_token_ids: list[int]) -> dict[str, float]:
    """Rank-0 only. Every set is sampled with the same per-prompt seeds (seed + i), as `mcore-rl-eval` does, so
    two evaluations differ only by the weights."""
    out: dict[str, float] = {}
    for i, hs in enumerate(sets):
        m = _evaluate_one(engine, reward_fn, hs, k, temperature, max_new_tokens, seed, stop_token_ids)
        if i == 0:
            out.update(m)
        if hs.prefixed:
            out.update({f"{hs.name}/{key}": v for key, v in m.items()})
    return out


def evaluate(engine, reward_fn, prompts: list[list[int]], answers: list[str], k: int, temperature: float,
             max_new_tokens: int, seed: int, stop_token_ids: list[int]) -> dict[str, float]:
    """One unnamed set scored by the trainer's reward (prompts + gold answers)."""

    @dataclass
    class _Rec:
        answer: str

    hs = HeldOutSet("heldout", prompts, [_Rec(a) for a in answers], prefixed=False)
    return evaluate_sets(engine, reward_fn, [hs], k, temperature, max_new_tokens, seed, stop_token_ids)
