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



def _has(result: RewardResult, reasons: tuple[str, ...]) -> bool:
    """Combined rewards write "name=reason,name=reason": look at every part."""
    parts = [p.split("=")[-1] for p in result.reason.split(",")]
    return any(p == r or p.startswith(r + ":") for p in parts for r in reasons)


# Reasons that mean the reward machinery failed (not the model). A timeout is counted apart: a model that writes
# 9**9**9 causes one legitimately.
CRASH_REASONS = ("worker_crash", "memory_limit", "error")


def failure_counts(results: list[RewardResult], prefix: str = "reward_") -> dict[str, float]:
    """Per-step counts of verifier-side failures: timeouts, crashes (worker died or hit its memory limit) and
    errors (the verifier raised)."""
    return {
        f"{prefix}timeouts": float(sum(_has(r, ("timeout",)) for r in results)),
        f"{prefix}crashes": float(sum(_has(r, ("worker_crash", "memory_limit")) for r in results)),
        f"{prefix}memory_limit": float(sum(_has(r, ("memory_limit",)) for r in results)),
        f"{prefix}errors": float(sum(_has(r, ("error",)) for r in results)),
    }


def crash_rate(results: list[RewardResult]) -> float:
    return sum(_has(r, CRASH_REASONS) for r in results) / max(1, len(results))


class CrashRateGuard:
    """Wraps a reward: a step whose crash rate passes `max_crash_rate` stops the run with one line, instead of
    training on all-zero rewards that only look like a model that never answers right."""

    def __init__(self, inner: RewardFn, max_crash_rate: float):
        if not 0.0 < max_crash_rate <= 1.0:
            raise ValueError(f"reward.max_crash_rate must be in (0, 1]; got {max_crash_rate}")
        self.inner, self.max_crash_rate = inner, max_crash_rate

    def score(self, responses: list[str], answers: list[str]) -> list[RewardResult]:
        from mcore_rl.agreement import FatalRunError

        results = self.inner.score(responses, answers)
        rate = crash_rate(results)
        if results and rate >= self.max_crash_rate:
            example = next(r.reason for r in results if _has(r, CRASH_REASONS))
            raise FatalRunError(f"reward crashed on {rate:.0%} of {len(results)} cases this step (e.g. {example}), "
                                f"at or above reward.max_crash_rate={self.max_crash_rate}; fix the reward")
        return results

    def close(self) -> None:
        self.inner.close()
