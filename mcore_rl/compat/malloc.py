"""glibc malloc tuning for long CPU training processes.

Why: torch's CPU allocator hands every tensor back to glibc when it is freed, and a training step allocates and
frees the same activation buffers every micro-batch. Two glibc defaults make that expensive:
- per-thread arenas keep freed buffers instead of returning them, so resident memory creeps up step after step
  (measured on SmolLM2-135M: 4.2 -> 5.9 GB over four steps): few arenas and a bounded trim threshold keep it flat;
- setting the trim threshold also freezes glibc's mmap threshold at its 128 KiB start value (glibc only adapts it
  while no threshold was set by hand), so every buffer above 128 KiB becomes a fresh mmap that the kernel
  zero-fills page by page on first touch and unmaps at free. A 64 MiB mmap threshold lets those buffers be reused
  from the heap. Measured (SmolLM2-135M bf16 fwd+bwd+Adam, 32 x 64 tokens, 10 steps, one thread each, same
  machine): CPU time 204 s -> 157 s (-23%), minor page faults 28.8 M -> 5.7 M; resident memory stays flat
  (2.77 -> 3.35 GB, unchanged from step 1 to 10; glibc's own defaults use 165 s and creep).
No-op where glibc's mallopt is unavailable.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
_DONE = False


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def tune_malloc(arena_max: int = 2, trim_threshold: int = 64 << 20, mmap_threshold: int = 64 << 20) -> bool:
    global _DONE
    if _DONE:
        return True
    try:
        libc = _libc()
        ok = all(
            bool(libc.mallopt(opt, value))
            for opt, value in (
                (M_ARENA_MAX, arena_max),
                (M_TRIM_THRESHOLD, trim_threshold),
                (M_MMAP_THRESHOLD, mmap_threshold),
            )
        )
    except (OSError, AttributeError):
        return False
    _DONE = ok
    return ok


def trim() -> bool:
    """Return the heap's free pages to the OS (glibc `malloc_trim(0)`, which also releases free pages inside the
    heap, not only at its top). Why, once per update: with the 64 MiB mmap threshold, activation buffers come from
    the heap, and RL micro-batches change shape every update; the freed buffers fragment the heap and resident
    memory grew ~0.2-0.4 GB per update in bf16 (SmolLM2 main job: 4.2 -> 8.4 GB over 20 updates; 10.6 GB after
    24 updates of an experiment arm, which the OOM killer then took), while a step's own reuse is what the
    threshold is for. No-op where glibc is unavailable."""
    try:
        return bool(_libc().malloc_trim(0))
    except (OSError, AttributeError):
        return False
