"""`model.dtype: auto`: pick bf16 mixed precision where this machine multiplies bf16 matrices fast, fp32 elsewhere.

Why measure instead of reading CPU flags: whether bf16 pays depends on the instruction set (AMX / AVX512-BF16),
on the oneDNN build and on the thread count; a CPU without native bf16 emulates it and runs slower than fp32.
One `torch.mm` of a transformer-sized shape in each dtype, timed at start (~0.6 s), answers the question for the
machine the job actually landed on. Every rank must train in the same dtype, so rank 0 decides and broadcasts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from mcore_rl.dtypes import BF16_MATMUL_MODES, SHORT, long_name

log = logging.getLogger("mcore_rl")

DTYPE_CHOICES = ("auto", *SHORT)
AUTO_MIN_SPEEDUP = 1.5  # bf16 must be at least this much faster than fp32 to be worth its rounding error


@dataclass(frozen=True)
class MatmulRates:
    fp32_gflops: float
    bf16_gflops: float

    @property
    def speedup(self) -> float:
        return self.bf16_gflops / self.fp32_gflops


@dataclass(frozen=True)
class Rate:
    """A measured rate per wall-clock second and per process CPU-second (the second is the steadier one on a
    machine shared with other jobs; on a GPU only the wall rate means anything)."""

    wall: float
    cpu: float


def time_matmul(
    dtype: torch.dtype,
    m: int,
    k: int,
    n: int,
    device: str | torch.device = "cpu",
    *,
    min_time: float = 0.1,
    repeats: int = 1,
) -> Rate:
    """GFLOP/s of `torch.mm` [m,k]x[k,n], best of the timed calls (at least `repeats`, until `min_time` seconds
    are spent), per wall-second and per CPU-second: best, not median, since other processes only slow it down.
    The one matmul probe of the project: `model.dtype=auto`, the speed summary and the engine's roofline."""
    device = torch.device(device)
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    torch.mm(a, b)  # warm-up (oneDNN primitive creation)
    best_wall = best_cpu = float("inf")
    spent, calls = 0.0, 0
    while spent < min_time or calls < repeats:
        t, c = time.perf_counter(), time.process_time()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt, dc = time.perf_counter() - t, time.process_time() - c
        best_wall, best_cpu = min(best_wall, dt), min(best_cpu, dc)
        spent, calls = spent + dt, calls + 1
    flop = 2.0 * m * k * n / 1e9
    return Rate(flop / best_wall, flop / max(best_cpu, 1e-9))


def matmul_gflops(
    dtype: torch.dtype, m: int = 2048, k: int = 576, n: int = 1536, min_time: float = 0.1, device: str = "cpu"
) -> float:
    """Wall GFLOP/s of `torch.mm` [m,k]x[k,n] on a transformer-sized shape (SmolLM2's MLP at 2048 tokens)."""
    return time_matmul(dtype, m, k, n, device, min_time=min_time).wall


def measure_matmul_rates(rounds: int = 3, **kw) -> MatmulRates:
    """Best of `rounds` interleaved fp32/bf16 timings: a burst of load from another process then slows both
    dtypes' samples alike instead of deciding the comparison (seen on shared 2-core machines)."""
    fp32 = bf16 = 0.0
    for _ in range(rounds):
        fp32 = max(fp32, matmul_gflops(torch.float32, **kw))
        bf16 = max(bf16, matmul_gflops(torch.bfloat16, **kw))
    return MatmulRates(fp32, bf16)


def resolve_dtype(dtype: str) -> str:
    """fp32 / bf16 / fp16 as given; `auto` -> bf16 on GPU, else by measurement (same answer on every rank)."""
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"model.dtype={dtype!r}: expected one of {list(DTYPE_CHOICES)}")
    if dtype != "auto":
        return dtype
    global _AUTO
    if _AUTO is None:
        _AUTO = _decide_auto()
    return _AUTO


_AUTO: str | None = None  # measured once per process (the policy and a reference model share the answer)
_RATES: MatmulRates | None = None  # what `auto` measured in this process (rank 0)


def roofline_gflops(dtype: str) -> float:
    """`torch.mm` GFLOP/s of `dtype` (fp32 / bf16 / fp16) on this machine: what `auto` measured at start-up, else
    measured now (best of 3, ~0.3 s in a fast dtype) and kept. The end-of-run speed summary divides achieved
    FLOP/s by it."""
    from mcore_rl.compat import bf16_matmul

    emulated = dtype == "bf16" and bf16_matmul.enabled()  # the rate of the products this process really runs
    if _RATES is not None and dtype in ("fp32", "bf16") and not emulated:
        return _RATES.fp32_gflops if dtype == "fp32" else _RATES.bf16_gflops
    key = "bf16-fp32-gemm" if emulated else dtype
    if key not in _MEASURED:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        tdt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        _MEASURED[key] = max(matmul_gflops(tdt, device=device) for _ in range(3))
    return _MEASURED[key]


_MEASURED: dict[str, float] = {}


def _decide_auto() -> str:
    if torch.cuda.is_available():
        log.warning("model.dtype=auto -> bf16 (CUDA)")
        return "bf16"
    from mcore_rl.distributed import broadcast, global_rank

    choice = torch.zeros(1)
    if global_rank() == 0:
        global _RATES
        rates = _RATES = measure_matmul_rates()
        pick = rates.speedup >= AUTO_MIN_SPEEDUP
        choice[0] = 1.0 if pick else 0.0
        log.warning("model.dtype=auto -> %s (torch.mm fp32 %.0f GFLOP/s, bf16 %.0f GFLOP/s, %.2fx; bf16 needs >= "
                    "%.1fx)", "bf16" if pick else "fp32", rates.fp32_gflops, rates.bf16_gflops, rates.speedup,
                    AUTO_MIN_SPEEDUP)
    choice = broadcast(choice, src=0)  # every rank trains in rank 0's choice
    return "bf16" if choice.item() > 0 else "fp32"


def configure_bf16_matmul(mode: str, dtypes: Iterable[str]) -> bool:
    """Whether this process's bf16 CPU matrix products run through fp32 GEMMs (compat/bf16_matmul.py: the same
    bf16 arithmetic at fp32 speed where the CPU has no bf16 matrix hardware). `mode`: `native` (torch's bf16
    kernels), `fp32` (always, on CPU), `auto` (where native bf16 `torch.mm` is slower than fp32, measured: the
    start-up probe of `model.dtype=auto` when it ran, else now). Only when a bf16 model runs here (`dtypes`: the
    trainer's and the engine's). Returns True when enabled; logged either way a bf16 model runs on CPU."""
    from mcore_rl.compat import bf16_matmul

    if mode not in BF16_MATMUL_MODES:
        raise ValueError(f"model.bf16_matmul={mode!r}: expected one of {list(BF16_MATMUL_MODES)}")
    bf16_matmul.disable()  # decided afresh (and measured on torch's own kernels)
    if not {"bf16", "bfloat16"} & set(dtypes) or torch.cuda.is_available():
        return False
    why = "model.bf16_matmul=fp32"
    if mode == "auto":
        rates = _RATES or measure_matmul_rates()
        why = f"native bf16 torch.mm {rates.bf16_gflops:.0f} GFLOP/s, fp32 {rates.fp32_gflops:.0f}"
        if rates.bf16_gflops >= rates.fp32_gflops:
            log.warning("bf16 matmuls: torch's native kernels (%s)", why)
            return False
    if mode == "native":
        log.warning("bf16 matmuls: torch's native kernels (model.bf16_matmul=native)")
        return False
    bf16_matmul.enable()
    log.warning("bf16 matmuls: bf16 operands, fp32 GEMM, result rounded to bf16 (%s; compat/bf16_matmul.py)", why)
    return True


def engine_dtype(rollout_dtype: str | None, train_dtype: str) -> str:
    """The embedded engine's torch dtype name: `auto`/None follows the trainer (fewer train/rollout mismatches
    than mixing precisions, and the engine gets the same bf16 speed-up)."""
    if rollout_dtype in (None, "auto"):
        return long_name(train_dtype)
    return long_name(rollout_dtype)
