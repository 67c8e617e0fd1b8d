"""Test-only plugins for `mcore-rl-train env=...` runs of the tiny random model (imported before the CLI's main).

The tiny model never spells a tool call nor a right answer, so a real environment would give every episode one
turn and reward 0: no multi-turn episode and no gradient. Registered here instead:
- tool format `test_hash_calls`: a reply calls `calc` when its text hashes to 1 or 2 mod 3 (about 2 replies in 3),
  so episodes take tool turns, with real tool results from the sandboxed pool appended between model turns;
- environment `test_graded_calc`: calculator's prompts, tool and limits; a reply without a tool call ends the
  episode with reward 1 when its text hashes even, else 0, so rewards vary inside a group.
"""

from __future__ import annotations

import zlib

from mcore_rl.envs import ENVS, Feedback
from mcore_rl.envs.calculator import CalculatorEnv
from mcore_rl.envs.tool_calls import TOOL_FORMATS, ToolCall


def _h(text: str) -> int:
    return zlib.crc32(text.encode())


@TOOL_FORMATS.register("test_hash_calls")
def _hash_calls(reply: str) -> list[ToolCall]:
    return [ToolCall("calc", {"expression": "48213*77-19"})] if _h(reply) % 3 else []


@ENVS.register("test_graded_calc")
class GradedCalculator(CalculatorEnv):
    def respond(self, episode, reply: str) -> Feedback:
        ok = _h(reply) % 2 == 0
        return Feedback(1.0 if ok else 0.0, True, correct=ok, reason="answered")
