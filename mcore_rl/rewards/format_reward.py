"""`format` reward: did the response state a final answer in a checkable form? No verifier, no processes.

Why: a small shaping term that teaches the model *where* to put the answer (\\boxed{} or a last-line
number), which makes the correctness reward readable sooner. Combine it with a small weight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mcore_rl.rewards.base import RewardResult, check_lengths
from mcore_rl.rewards.extract import final_line_is_number, has_boxed_answer, tail
from mcore_rl.rewards.registry import register_reward
from mcore_rl.utils import config_from_dict

FORMAT_CHECKS: dict[str, Callable[[str], bool]] = {
    "boxed": has_boxed_answer,
    "final_number": final_line_is_number,
    "boxed_or_final_number": lambda text: has_boxed_answer(text) or final_line_is_number(text),
}


@dataclass
class FormatConfig:
    check: str = "boxed_or_final_number"
    max_chars: int = 16384


class FormatReward:
    """1.0 if the response passes `check`, else 0.0 (`correct` is always False: format is not correctness)."""

    def __init__(self, cfg: FormatConfig | None = None):
        self.cfg = cfg or FormatConfig()
        if self.cfg.check not in FORMAT_CHECKS:
            raise ValueError(f"reward format.check={self.cfg.check!r} unknown; choose from {sorted(FORMAT_CHECKS)}")
        self._check = FORMAT_CHECKS[self.cfg.check]

    def score(self, responses: list[str], answers: list[str]) -> list[RewardResult]:
        check_lengths(responses, answers)
        out = []
        for text in responses:
            if not isinstance(text, str):
                out.append(RewardResult(0.0, False, f"invalid_response:{type(text).__name__}", None))
            elif self._check(tail(text, self.cfg.max_chars)):
                out.append(RewardResult(1.0, False, "format_ok", None))
            else:
                out.append(RewardResult(0.0, False, "format_bad", None))
        return out

    def close(self) -> None:
        pass


@register_reward("format", FormatConfig)
def build_format(options: dict[str, Any]) -> FormatReward:
    return FormatReward(config_from_dict(FormatConfig, options, "reward.format"))
