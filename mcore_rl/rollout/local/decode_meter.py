"""The embedded engine's decode work per round, against the decode roofline of the very steps it ran.

Why: the speed summary's generate line can only divide the run's counted FLOPs by the matmul peak, and both are
wrong for decoding: the compute accounting (evaluation/compute.py) charges a prompt's prefill once per sample
while the engine prefills it once for all n, and a decode step streams every weight for a few rows, so its bound is
min(matmul rate, weight + KV streaming), not the matmul peak. On the main job that read "91.9% of roofline" for an
engine that `benchmarks/rollout_engine.py` puts at a third of its decode roofline. The meter takes the engine's own
step records (rows and cache columns per step, EngineStats) since the last round and the same roofline as the
benchmark (rollout/local/roofline.py), at the matmul rate the run already measured (policy/precision.py) and a read
bandwidth measured once.

The step records are appended by the engine's worker thread; under the async schedule a step may land on either
side of a round's read. A summary over a run does not notice one step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mcore_rl.dtypes import short_name
from mcore_rl.rollout.local.engine_stats import EngineStats
from mcore_rl.rollout.local.roofline import DecodeCost, bandwidth_gbs, decode_roofline


@dataclass
class DecodeMeter:
    cost: DecodeCost
    device: torch.device
    dtype: torch.dtype
    rates: tuple[float, float] | None = None  # (matmul GFLOP/s, read GB/s), measured at the first round
    _seen_steps: int = 0
    _last: dict[str, float] = field(default_factory=dict)

    def _rates(self) -> tuple[float, float]:
        if self.rates is None:
            from mcore_rl.policy.precision import roofline_gflops

            # 256 MB: far past any CPU's or GPU's last-level cache, small next to a run's memory
            self.rates = roofline_gflops(short_name(self.dtype)), bandwidth_gbs(self.device).wall
        return self.rates

    def round_metrics(self, stats: EngineStats) -> dict[str, float]:
        """Decode and prefill work since the previous call (evaluation's generation included): tokens, seconds and
        `engine_decode_bound_s`, the roofline's seconds for the same decode steps."""
        total = stats.steps
        rows, kv = list(stats.batch_sizes), list(stats.kv_lengths)
        n = min(len(rows), len(kv), max(0, total - self._seen_steps))
        steps = list(zip(rows[len(rows) - n:], kv[len(kv) - n:]))
        self._seen_steps = total
        gflops, gbs = self._rates()
        now = {"engine_decode_tokens": float(stats.decode_tokens), "engine_decode_s": stats.decode_s,
               "engine_prefill_tokens": float(stats.prefill_tokens), "engine_prefill_s": stats.prefill_s}
        out = {k: v - self._last.get(k, 0.0) for k, v in now.items()}
        self._last = now
        out["engine_decode_bound_s"] = decode_roofline(self.cost, steps, gflops, gbs).bound_s
        if out["engine_decode_s"] > 0:
            out["engine_decode_roofline_frac"] = out["engine_decode_bound_s"] / out["engine_decode_s"]
        return out
