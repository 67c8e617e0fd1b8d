"""Reward result type, the protocol every reward implements, and the per-step failure counts the trainer logs."""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class RewardResult:
    """One scored case. `reason` says why (e.g. "correct", "wrong_answer", "timeout"), always set. `metrics`: extra
    per-sample numbers a reward reports (a reward function's dict keys, a service's `extra_logs`), logged as
    `reward/<key>` means."""

    score: float
    correct: bool
    reason: str
    extracted: str | None
    latency_s: float = 0.0  # dispatch -> answer, measured by the parent; 0 for in-process rewards
    metrics: dict[str, float] = field(default_factory=dict)


class RewardFn(Protocol):
    """`score` is synchronous and order-preserving; `close` releases worker processes (idempotent).

    `records[i]` is response i's prompt record as a plain dict (prompt_id, prompt, answer, metadata; the trainer
    adds prompt_text and query for rewards with `uses_text`). It is optional so that rewards written against
    `score(responses, answers)` keep working: callers go through `score_with_records`, which passes records only
    to a `score` that accepts them. Optional extras: `describe() -> str` (the start-up line) and `metrics() ->
    dict` (numbers since the last call, e.g. HTTP retries)."""

    def score(self, responses: list[str], answers: list[str], records: list[dict] | None = None
              ) -> list[RewardResult]: ...

    def close(self) -> None: ...


def check_lengths(responses: list, answers: list, records: list | None = None) -> None:
    if len(responses) != len(answers) or (records is not None and len(records) != len(responses)):
        extra = "" if records is None else f" and {len(records)} records"
        raise ValueError(f"reward: got {len(responses)} responses but {len(answers)} answers{extra}; they must pair up")


def _takes_records(fn: Any) -> bool:
    try:
        params = inspect.signature(fn.score).parameters
    except (TypeError, ValueError):
        return False
    return "records" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def score_with_records(fn: Any, responses: list, answers: list, records: list[dict] | None) -> list[RewardResult]:
    """`fn.score` with the records when it takes them (the protocol's third argument), without them otherwise."""
    if records is not None and _takes_records(fn):
        return fn.score(responses, answers, records=records)
    return fn.score(responses, answers)


def record_dict(record: Any) -> dict[str, Any]:
    """A prompt record as the plain (picklable) dict reward functions receive: a dict as given, a PromptRecord's
    four fields, or what a trainer-side prompt has (its id and answer)."""
    if isinstance(record, dict):
        return record
    if dataclasses.is_dataclass(record) and hasattr(record, "metadata") and hasattr(record, "prompt"):
        return dataclasses.asdict(record)
    return {"prompt_id": getattr(record, "prompt_id", None), "prompt": getattr(record, "prompt", None),
            "answer": getattr(record, "answer", None), "metadata": dict(getattr(record, "metadata", None) or {})}


def finite_number(value: Any) -> float | str:
    """A finite float, or the `invalid:<what>` reason why not (strings are never parsed: a score is a number)."""
    if value is None or isinstance(value, (str, bytes)):
        return f"invalid:{type(value).__name__}"
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):
        return f"invalid:{type(value).__name__}"
    if math.isnan(x):
        return "invalid:nan"
    return "invalid:inf" if math.isinf(x) else x


def uses_text(fn: Any) -> bool:
    """Whether `fn` needs each record's templated prompt and OpenRLHF-style query (a remote service does)."""
    return bool(getattr(fn, "uses_text", False))


def describe(fn: Any) -> str:
    """One line for the start-up log: the reward's own `describe()`, else its class and settings (`cfg`)."""
    if hasattr(fn, "describe"):
        return str(fn.describe())
    cfg = getattr(fn, "cfg", None)
    if dataclasses.is_dataclass(cfg):
        return f"{type(fn).__name__}({', '.join(f'{k}={v}' for k, v in dataclasses.asdict(cfg).items())})"
    return type(fn).__name__


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


# Reasons that mean the reward machinery failed (not the model): a verifier or reward function that died, raised or
# returned no number, a reward service, reward model server or LLM judge that failed after its retries. A timeout
# is counted apart: a model that writes 9**9**9 causes one legitimately.
CRASH_REASONS = ("worker_crash", "memory_limit", "error", "invalid", "remote_error", "judge_error")


def failure_counts(results: list[RewardResult], prefix: str = "reward_") -> dict[str, float]:
    """Per-step counts of verifier-side failures: timeouts, crashes (worker died or hit its memory limit) and
    errors (the verifier raised)."""
    return {
        f"{prefix}timeouts": float(sum(_has(r, ("timeout",)) for r in results)),
        f"{prefix}crashes": float(sum(_has(r, ("worker_crash", "memory_limit")) for r in results)),
        f"{prefix}memory_limit": float(sum(_has(r, ("memory_limit",)) for r in results)),
        f"{prefix}errors": float(sum(_has(r, ("error",)) for r in results)),
    }


def extra_metric_means(results: list[RewardResult], prefix: str = "reward/") -> dict[str, float]:
    """`reward/<key>`: the mean of each extra per-sample metric over the samples that reported it."""
    sums: Counter = Counter()
    counts: Counter = Counter()
    for r in results:
        for k, v in r.metrics.items():
            sums[k] += v
            counts[k] += 1
    return {f"{prefix}{k}": sums[k] / counts[k] for k in sorted(counts)}


def step_metrics(fn: Any, results: list[RewardResult]) -> dict[str, float]:
    """Everything a scored step logs about its reward: failure counts (with `reward_invalid`: a reward function
    returned no usable number; `reward_remote_failures`: samples of a service request that failed after its
    retries), the extra metrics' means, and the reward's own counters (`metrics()`)."""
    out = failure_counts(results)
    out["reward_invalid"] = float(sum(_has(r, ("invalid",)) for r in results))
    out["reward_remote_failures"] = float(sum(_has(r, ("remote_error",)) for r in results))
    out.update(extra_metric_means(results))
    if hasattr(fn, "metrics"):
        out.update(fn.metrics())
    return out


def crash_rate(results: list[RewardResult]) -> float:
    return sum(_has(r, CRASH_REASONS) for r in results) / max(1, len(results))


def check_crash_rate(max_crash_rate: float) -> float:
    """`reward.max_crash_rate` as a float in (0, 1], else one ValueError line (checked before any model is built
    and again where the guard is made)."""
    rate = float(max_crash_rate)
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"reward.max_crash_rate must be in (0, 1]; got {max_crash_rate}")
    return rate


class CrashRateGuard:
    """Wraps a reward: a step whose crash rate passes `max_crash_rate` stops the run with one line, instead of
    training on all-zero rewards that only look like a model that never answers right."""

    def __init__(self, inner: RewardFn, max_crash_rate: float):
        self.inner, self.max_crash_rate = inner, check_crash_rate(max_crash_rate)
        self.uses_text = uses_text(inner)

    def score(self, responses: list[str], answers: list[str], records: list[dict] | None = None
              ) -> list[RewardResult]:
        from mcore_rl.agreement import FatalRunError

        results = score_with_records(self.inner, responses, answers, records)
        rate = crash_rate(results)
        if results and rate >= self.max_crash_rate:
            example = next(r.reason for r in results if _has(r, CRASH_REASONS))
            raise FatalRunError(f"reward crashed on {rate:.0%} of {len(results)} cases this step (e.g. {example}), "
                                f"at or above reward.max_crash_rate={self.max_crash_rate}; fix the reward")
        return results

    def describe(self) -> str:
        return f"{describe(self.inner)}; max_crash_rate={self.max_crash_rate}"

    def metrics(self) -> dict[str, float]:
        return self.inner.metrics() if hasattr(self.inner, "metrics") else {}

    def close(self) -> None:
        self.inner.close()
