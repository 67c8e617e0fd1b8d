"""compat/malloc.py: with the tuned thresholds, activation-sized buffers come from the heap and freed ones stay
resident; `trim()` (called once per update by the trainer loop) hands them back. In a fresh process (the settings
are process-wide): allocate buffers of RL-like varying sizes, free them, and compare resident memory around trim."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

SCRIPT = r"""
import random
from mcore_rl.compat.malloc import trim, tune_malloc
assert tune_malloc()
import torch

def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

base = rss_mb()
rng = random.Random(0)
for _ in range(6):  # six "updates", each with buffers of new shapes (1-48 MiB), all freed at the end
    bufs = [torch.ones(rng.randint(1, 48) << 18) for _ in range(24)]
    del bufs
before = rss_mb()
assert trim()
after = rss_mb()
print(f"{base:.0f} {before:.0f} {after:.0f}")
"""


def test_trim_returns_freed_heap_buffers():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    base, before, after = map(float, out.stdout.split())
    assert before - base > 100, (base, before, after)  # freed buffers stayed resident (the growth seen per update)
    assert after - base < 0.5 * (before - base), (base, before, after)  # trim gave most of it back
