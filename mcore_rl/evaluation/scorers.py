"""Scorers for held-out sets: math-verify (the training reward's correctness) and reasoning-gym's own scorer.

Why reasoning-gym needs its own: many of its tasks are not numeric (words, lists, boards, expressions), and each
task defines what counts as right in `dataset.score_answer(answer, entry)`; math-verify would mark them wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from mcore_rl.data import PromptRecord
from mcore_rl.rewards.base import RewardResult, record_dict, score_with_records
from mcore_rl.rewards.extract import extract_answer


class Scorer(Protocol):
    """`correct(responses, records)` -> one bool per response (records[i] is response i's prompt)."""

    def correct(self, responses: list[str], records: list[PromptRecord]) -> list[bool]: ...

    def reward_means(self) -> dict[str, float]:
        """The last `correct` call's mean reward (`reward_mean`) and per-sample reward metrics (`reward/<key>`):
        what a reward model or judge is judged by, since neither says what is correct. {} without a reward."""
        ...

    def close(self) -> None: ...


class RewardScorer:
    """Correctness read off a reward's `correct` field: the trainer's own reward scores its default held-out set
    this way. The reward is borrowed, not closed here."""

    def __init__(self, reward) -> None:
        self.reward = reward
        self._means: dict[str, float] = {}

    def correct(self, responses: list[str], records: list[PromptRecord]) -> list[bool]:
        results = score_with_records(self.reward, responses, [rec.answer for rec in records],
                                     [record_dict(rec) for rec in records])
        self._means = reward_means(results)
        return [bool(r.correct) for r in results]

    def reward_means(self) -> dict[str, float]:
        return dict(self._means)

    def close(self) -> None:
        pass


class MathVerifyScorer(RewardScorer):
    """The trainer's `math_verify` reward (its worker pool), reading only `correct`. `reward`: an existing reward
    to borrow (the trainer's periodic eval passes its own, so no second worker pool is started; not closed here)."""

    def __init__(self, options: dict[str, Any], reward=None) -> None:
        from mcore_rl.rewards import build_reward

        self._owned = reward is None
        super().__init__(build_reward({"name": "math_verify"}) if reward is None else reward)

    def close(self) -> None:
        if self._owned:
            self.reward.close()


def reasoning_gym_candidate(response: str) -> str | None:
    """reasoning-gym's <answer>...</answer> convention first, then our own extraction (boxed / phrase / number);
    for a one-line response with no number, the line itself (word answers)."""
    from reasoning_gym.utils import extract_answer as rg_extract

    tagged = rg_extract(response)
    if tagged:
        return tagged
    found = extract_answer(response)
    if found is not None:
        return found.candidate
    lines = [ln.strip() for ln in response.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else None


class ReasoningGymScorer:
    """Rebuilds the same reasoning-gym dataset (name, size, seed, options) and asks it to score each answer;
    full marks (score >= 1) count as correct, partial credit does not."""

    def __init__(self, options: dict[str, Any]) -> None:
        import reasoning_gym

        if options.get("kind") != "reasoning_gym":
            raise ValueError("scorer=reasoning_gym only applies to reasoning_gym/NAME sets")
        self.dataset = reasoning_gym.create_dataset(options["name"], size=options.get("size", 1024),
                                                    seed=options.get("seed", 0), **(options.get("options") or {}))

    def correct(self, responses: list[str], records: list[PromptRecord]) -> list[bool]:
        out = []
        for text, rec in zip(responses, records):
            entry = self.dataset[int(rec.prompt_id.rsplit("-", 1)[1])]
            candidate = reasoning_gym_candidate(text or "")
            out.append(candidate is not None and float(self.dataset.score_answer(candidate, entry)) >= 1.0 - 1e-9)
        return out

    def reward_means(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


def reward_means(results: list[RewardResult]) -> dict[str, float]:
    """`reward_mean` over the results and, per metric key, `reward/<key>` over the results that report it."""
    if not results:
        return {}
    out = {"reward_mean": float(np.mean([r.score for r in results]))}
    keys = sorted({k for r in results for k in r.metrics})
    for k in keys:
        out[f"reward/{k}"] = float(np.mean([r.metrics[k] for r in results if k in r.metrics]))
    return out


SCORERS: dict[str, Callable[[dict[str, Any]], Scorer]] = {
    "math_verify": MathVerifyScorer,
    "reasoning_gym": ReasoningGymScorer,
}


def build_scorer(name: str, options: dict[str, Any], reward=None) -> Scorer:
    """`reward`: an existing correctness reward that math_verify scoring may borrow instead of starting its own."""
    if reward is not None and name == "math_verify":
        return MathVerifyScorer(options, reward=reward)
    return SCORERS[name](options)
