"""Scorers for held-out sets: math-verify (the training reward's correctness) and reasoning-gym's own scorer.

Why reasoning-gym needs its own: many of its tasks are not numeric (words, lists, boards, expressions), and each
task defines what counts as right in `dataset.score_answer(answer, entry)`; math-verify would mark them wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from mcore_rl.data import PromptRecord
from mcore_rl.rewards.base import record_dict, score_with_records
from mcore_rl.rewards.extract import extract_answer


class Scorer(Protocol):
    """`correct(responses, records)` -> one bool per response (records[i] is response i's prompt)."""

    def correct(self, responses: list[str], records: list[PromptRecord]) -> list[bool]: ...

    def close(self) -> None: ...


class RewardScorer:
    """Correctness read off a reward's `correct` field: the trainer's own reward scores its default held-out set
    this way. The reward is borrowed, not closed here."""

    def __init__(self, reward) -> None:
        self.reward = reward

    def correct(self, responses: list[str], records: list[PromptRecord]) -> list[bool]:
        results = score_with_records(self.reward, responses, [rec.answer for rec in records],
                                     [record_dict(rec) for rec in records])
        return [bool(r.correct) for r in results]

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

    def close(self) -> None:
        pass


SCORERS: dict[str, Callable[[dict[str, Any]], Scorer]] = {
    "math_verify": MathVerifyScorer,
    "reasoning_gym": ReasoningGymScorer,
}


def build_scorer(name: str, options: dict[str, Any], reward=None) -> Scorer:
    """`reward`: an existing correctness reward that math_verify scoring may borrow instead of starting its own."""
    if reward is not None and name == "math_verify":
        return MathVerifyScorer(options, reward=reward)
    return SCORERS[name](options)
