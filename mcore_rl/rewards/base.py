"""Reward result type and the protocol every reward implements."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol


@dataclass
class RewardResult:
    """One scored case. `reason` says why (e.g. "correct", "wrong_answer", "timeout"), always set."""

    score: float
    correct: bool
    reason: str
    extracted: str | None
    latency_s: float = 0.0  # dispatch -> answer, measured by the parent; 0 for in-process rewards


class RewardFn(Protocol):
    """`score` is synchronous and order-preserving; `close` releases worker processes (idempotent)."""

    def score(self, responses: list[str], answers: list[str]) -> list[RewardResult]: ...

    def close(self) -> None: ...


def check_lengths(responses: list, answers: list) -> None:
    if len(responses) != len(answers):
        raise ValueError(f"reward: got {len(responses)} responses but {len(answers)} answers; they must pair up")


def reward_metrics(results: list[RewardResult], prefix: str = "reward/") -> dict[str, float]:
    """Scalar metrics for logging: mean score, accuracy, max latency and the fraction of each reason."""
    n = max(1, len(results))
    metrics = {
        f"{prefix}mean": sum(r.score for r in results) / n,
        f"{prefix}accuracy": sum(r.correct for r in results) / n,
        f"{prefix}latency_max_s": max((r.latency_s for r in results), default=0.0),
    }
    for reason, count in Counter(r.reason.split(":")[0] for r in results).items():
        metrics[f"{prefix}reason/{reason}"] = count / n
    return metrics
