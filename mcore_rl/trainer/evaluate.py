"""Held-out evaluation: the same fixed prompts every time, k samples each -> mean@k and pass@1..k (the unbiased
estimator shared with `mcore-rl-eval`, mcore_rl/evaluation/passk.py)."""

from __future__ import annotations

import torch

from mcore_rl.evaluation.passk import summarize_correct
from mcore_rl.rollout.protocol import GenerationRequest, SamplingParams


def evaluate(engine, reward_fn, prompts: list[list[int]], answers: list[str], k: int, temperature: float,
             max_new_tokens: int, seed: int, stop_token_ids: list[int]) -> dict[str, float]:
    """Rank-0 only. Seeds are fixed per prompt so two evaluations differ only by the weights."""
    reqs = [GenerationRequest(prompt_ids=p, rid=f"eval-{i}",
                              sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, n=k,
                                                      seed=seed + i, stop_token_ids=stop_token_ids))
            for i, p in enumerate(prompts)]
    samples = engine.generate(reqs)
    results = reward_fn.score([s.text or "" for s in samples], [a for a in answers for _ in range(k)])
    correct = torch.tensor([bool(r.correct) for r in results]).view(len(prompts), k)
    lengths = torch.tensor([float(len(s.output_ids)) for s in samples])
    summary = summarize_correct(correct.numpy())
    return {
        "mean_at_k": summary["mean_at_n"],
        "pass_at_k": summary[f"pass_at_{k}"],  # pass@k at k = n: "any of the k samples correct"
        **{key: v for key, v in summary.items() if key.startswith("pass_at_")},
        "k": float(k),
        "num_prompts": float(len(prompts)),
        "response_len": lengths.mean().item(),
    }
