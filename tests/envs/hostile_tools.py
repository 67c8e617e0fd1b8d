"""Tool functions that misbehave, for the sandbox tests (imported only inside tool workers)."""

from __future__ import annotations

import time


def sleep(seconds: float) -> str:
    time.sleep(float(seconds))
    return "woke"


def hog(mb: int) -> str:
    blocks = [bytearray(2**20) for _ in range(int(mb))]
    return str(len(blocks))


def boom() -> str:
    raise RuntimeError("tool bug")
