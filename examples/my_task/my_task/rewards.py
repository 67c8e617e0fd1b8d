"""The reward function: `reward=function reward.function.path=my_task.rewards:score`.

It runs in mcore-rl's sandboxed reward workers (a timeout, memory and CPU limits; a crash scores 0 and is counted),
so it may be slow or buggy without taking the run down. Returning a dict logs every extra key as a metric."""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+")


def score(response: str, answer: str, record: dict) -> dict:
    """1.0 when the last number in the reply is the answer. The other keys are logged as `reward/has_number` and
    `reward/words` (means over the step's samples)."""
    numbers = _NUMBER.findall(response)
    correct = bool(numbers) and numbers[-1] == answer.strip()
    return {"score": float(correct), "has_number": float(bool(numbers)), "words": float(len(response.split()))}
