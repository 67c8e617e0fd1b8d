"""glibc malloc tuning for long CPU training processes.

Why: torch's CPU allocator hands large activation buffers back to glibc, which keeps them in per-thread arenas
instead of returning them to the OS, so resident memory creeps up step after step (measured on SmolLM2-135M:
4.2 -> 5.9 GB over four steps). Few arenas and a bounded trim threshold keep it flat (2.5 GB after every step).
No-op where glibc's mallopt is unavailable.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_ARENA_MAX = -8
_DONE = False


def tune_malloc(arena_max: int = 2, trim_threshold: int = 64 << 20) -> bool:
    global _DONE
    if _DONE:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = bool(libc.mallopt(M_ARENA_MAX, arena_max)) and bool(libc.mallopt(M_TRIM_THRESHOLD, trim_threshold))
    except (OSError, AttributeError):
        return False
    _DONE = ok
    return ok
