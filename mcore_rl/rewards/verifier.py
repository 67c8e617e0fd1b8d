"""`math_verify` reward: size guards in the parent, extraction + math-verify in a killable process pool."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from mcore_rl.rewards.base import RewardResult, check_lengths
from mcore_rl.rewards.extract import tail
from mcore_rl.rewards.pool import VerifierPool
from mcore_rl.rewards.registry import register_reward
from mcore_rl.rewards.worker import WorkerOptions
from mcore_rl.utils import config_from_dict

logger = logging.getLogger(__name__)

# Failures that mean the verifier (not the model) had a problem: worth a warning.
_LOUD = ("timeout", "worker_crash", "memory_limit", "error")


@dataclass
class MathVerifyConfig:
    num_workers: int = 2
    timeout_s: float = 5.0  # hard per-case deadline; the worker is killed and replaced past it
    max_chars: int = 16384  # only the tail of longer responses is looked at (the answer is at the end)
    max_answer_chars: int = 512
    max_nesting: int = 32
    mp_context: str = "forkserver"  # or spawn; never fork (the trainer holds torch/gloo threads)
    max_tasks_per_worker: int = 0  # >0: recycle workers after that many cases (bounds sympy cache growth)
    startup_timeout_s: float = 120.0
    memory_limit_mb: int = 4096  # address space a worker may grow by (RLIMIT_AS); past it: 0, "memory_limit"


def _prefilter(response: object, answer: object) -> RewardResult | None:
    """Cases that never need a worker: wrong types and empty strings."""
    if not isinstance(response, str):
        return RewardResult(0.0, False, f"invalid_response:{type(response).__name__}", None)
    if not response.strip():
        return RewardResult(0.0, False, "empty_response", None)
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        return RewardResult(0.0, False, f"invalid_answer:{type(answer).__name__}", None)
    if not str(answer).strip():
        return RewardResult(0.0, False, "empty_answer", None)
    return None


class MathVerifyReward:
    """1.0 if the extracted answer is mathematically equal to the gold answer (math-verify), else 0.0."""

    def __init__(self, cfg: MathVerifyConfig | None = None):
        self.cfg = cfg = cfg or MathVerifyConfig()
        if cfg.max_chars < 16:
            raise ValueError(f"reward max_chars must be >= 16, got {cfg.max_chars}")
        opts = WorkerOptions(
            cpu_limit_s=int(cfg.timeout_s) + 5,
            max_answer_chars=cfg.max_answer_chars,
            max_nesting=cfg.max_nesting,
            memory_limit_mb=cfg.memory_limit_mb,
        )
        self.pool = VerifierPool(
            num_workers=cfg.num_workers,
            timeout_s=cfg.timeout_s,
            mp_context=cfg.mp_context,
            startup_timeout_s=cfg.startup_timeout_s,
            max_tasks_per_worker=cfg.max_tasks_per_worker,
            options=opts,
        )

    def score(self, responses: list[str], answers: list[str]) -> list[RewardResult]:
        check_lengths(responses, answers)
        results: list[RewardResult | None] = [_prefilter(r, a) for r, a in zip(responses, answers)]
        todo = [i for i, r in enumerate(results) if r is None]
        cases = [(tail(responses[i], self.cfg.max_chars), str(answers[i]).strip()) for i in todo]
        for i, ((score, correct, reason, extracted), latency) in zip(todo, self.pool.map(cases)):
            results[i] = RewardResult(score, correct, reason, extracted, latency)
        for i, r in enumerate(results):
            if r.score == 0.0:
                level = logging.WARNING if r.reason.startswith(_LOUD) else logging.DEBUG
                if logger.isEnabledFor(level):
                    snippet = responses[i][-120:] if isinstance(responses[i], str) else responses[i]
                    logger.log(level, "math_verify 0 (%s) case %d: extracted=%r gold=%r response tail=%r",
                               r.reason, i, r.extracted, answers[i], snippet)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        self.pool.close()


@register_reward("math_verify", MathVerifyConfig)
def build_math_verify(options: dict[str, Any]) -> MathVerifyReward:
    return MathVerifyReward(config_from_dict(MathVerifyConfig, options, "reward.math_verify"))
