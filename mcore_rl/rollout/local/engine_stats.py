"""What the local engine's worker counts and times, per step (read by runs and benchmarks/rollout_engine.py)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """Counters and timings of the engine's steps (whichever thread ran them), so a run (or
    benchmarks/rollout_engine.py) can set what the engine achieved against the roofline of the batches it ran."""

    steps: int = 0
    prefill_tokens: int = 0  # prompt tokens run through the model (a prompt shared by n samples counts once)
    decode_tokens: int = 0
    batch_sizes: deque = field(default_factory=lambda: deque(maxlen=100_000))  # rows per decode step
    kv_lengths: deque = field(default_factory=lambda: deque(maxlen=100_000))  # cache columns read per step
    regenerated: int = 0  # samples restarted from their prompt by a weight update (interrupt mode)
    decode_s: float = 0.0  # wall-clock of decode steps (forward + sampling; the token read-back syncs a GPU)
    decode_cpu_s: float = 0.0  # process CPU time over the same steps (steadier on a shared machine)
    prefill_s: float = 0.0
    prefill_cpu_s: float = 0.0
