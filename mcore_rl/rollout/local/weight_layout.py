"""How the decode step stores its layer weights on this machine: [out, in] (PyTorch's own) or [in, out].

Why a choice, and why measured: a decode step multiplies every layer weight by a skinny [rows, hidden] activation,
and a CPU BLAS runs that product at rates that depend on which operand is transposed, differently per CPU.
PyTorch keeps a Linear's weight as [out, in], so `x @ W^T` is a transposed-B ("NT") GEMM. Measured on an Intel
Xeon (AVX-512, MKL, fp32, 1 thread, SmolLM2's 30 layers' q/k/v, o, gate/up and down GEMMs, CPU time, best of 9):

| rows | 1 | 2 | 4 | 8 | 16 | 36 | 64 |
|---|---|---|---|---|---|---|---|
| `F.linear(x, W)`, W [out, in] | 15.3 | 15.9 | 30.2 | 44.9 | 53.0 | 79.5 | 115.5 ms |
| `W @ x^T` (decode_forward.linear's form up to 4 rows) | 36.8 | 33.7 | 34.5 | 35.7 | 35.4 | 78.4 | 111.8 ms |
| `x @ W_t`, W_t [in, out] contiguous | 16.2 | 18.9 | 19.2 | 20.5 | 30.9 | 54.4 | 86.3 ms |

On the AMD EPYC the `W @ x^T` form was tuned on, it halves the 1-4 row cost and oneDNN's prepacked weights (which
run like `x @ W_t` on the Intel CPU) were within 5% of `F.linear`. No fixed rule is right on both, so the engine
times one layer's GEMMs in both layouts at start (~50 ms) and stores the weights [in, out] only where that is
clearly faster (MIN_SPEEDUP), for fp32 on a CPU and a model wide enough for the timing to mean something. The
LM head's CPU form goes with the choice (lm_head.py): its regrouped products were tuned with the `W @ x^T` rule on
the AMD EPYC and lose to the plain product where [in, out] wins (on the Intel Xeon at 2 threads: 1.05-1.3x).

The [in, out] layout costs no memory: the HF parameters become transposed views of the [in, out] buffers (q/k/v
and gate/up as column slices of one buffer per layer), so the model's own forward (prefill, the HF decode path)
runs on the same storage and an in-place weight update lands there (a transposed copy; SmolLM2's 425 MB of layer
weights took 0.17 s, the same as a plain copy). The products are the same dot products, summed in the order the
GEMM picks: equal to float rounding.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from mcore_rl.rollout.local.lm_head import REGROUP_DTYPES

log = logging.getLogger(__name__)

LAYOUTS = ("auto", "out", "in")
MIN_SPEEDUP = 1.15  # [in, out] must be at least this much faster: a near tie keeps PyTorch's layout, run to run
MIN_HIDDEN = 256  # below: the GEMMs take microseconds and the timing would decide at random
PROBE_ROWS = (4, 16, 48)  # a decode batch from its shrinking tail to a full round
PROBE_REPEATS = 7


@dataclass(frozen=True)
class LayoutChoice:
    in_major: bool
    why: str
    measured: bool = False  # decided by timing this machine (logged where a run's log shows it)

    @property
    def name(self) -> str:
        return "in" if self.in_major else "out"


def layer_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's decode GEMMs: fused q/k/v, o, fused gate/up, down."""
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    qkv = sum(lin.weight.shape[0] for lin in (attn.q_proj, attn.k_proj, attn.v_proj))
    gate_up = mlp.gate_proj.weight.shape[0] + mlp.up_proj.weight.shape[0]
    return [(qkv, attn.q_proj.weight.shape[1]), tuple(attn.o_proj.weight.shape),
            (gate_up, mlp.gate_proj.weight.shape[1]), tuple(mlp.down_proj.weight.shape)]


def measure(shapes: list[tuple[int, int]], dtype: torch.dtype, rows: tuple[int, ...] = PROBE_ROWS,
            repeats: int = PROBE_REPEATS) -> tuple[float, float]:
    """Process CPU seconds of the shapes' GEMMs at each row count, [out, in] (through decode_forward.linear, the
    form the engine would run) vs [in, out], on one thread; the two alternate and each keeps its best of
    `repeats`."""
    from mcore_rl.rollout.local.decode_forward import linear

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen, dtype=torch.float32).to(dtype) for n, k in shapes]
    transposed = [w.t().contiguous() for w in weights]
    inputs = [[torch.randn(r, k, generator=gen, dtype=torch.float32).to(dtype) for _, k in shapes] for r in rows]
    best = [float("inf"), float("inf")]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: no OpenMP spin-waits on a shared machine to blur the comparison
    try:
        for _ in range(repeats):
            for i, in_major in enumerate((False, True)):
                start = time.process_time()
                for xs in inputs:
                    for x, w, wt in zip(xs, weights, transposed):
                        torch.mm(x, wt) if in_major else linear(x, w, None)
                best[i] = min(best[i], time.process_time() - start)
    finally:
        torch.set_num_threads(threads)
    return best[0], best[1]


def choose(model: torch.nn.Module, mode: str, device: torch.device, dtype: torch.dtype) -> LayoutChoice:
    """rollout.weight_layout: `out` / `in` as given; `auto` measures where the choice can pay (module docstring)."""
    if mode not in LAYOUTS:
        raise ValueError(f"rollout.weight_layout={mode!r}: expected one of {', '.join(LAYOUTS)}")
    from mcore_rl.rollout.local.decode_forward import unsupported

    if mode != "auto":
        return LayoutChoice(mode == "in", "rollout.weight_layout")
    if unsupported(model):
        return LayoutChoice(False, "auto: the model's own decode forward")
    if device.type != "cpu":
        return LayoutChoice(False, f"auto: {device.type} keeps PyTorch's layout")
    if dtype not in REGROUP_DTYPES:
        return LayoutChoice(False, f"auto: {str(dtype).removeprefix('torch.')} keeps PyTorch's layout")
    shapes = layer_shapes(model)
    if min(k for _, k in shapes) < MIN_HIDDEN:
        return LayoutChoice(False, f"auto: hidden size below {MIN_HIDDEN}, too small to time")
    t_out, t_in = measure(shapes, dtype)
    speedup = t_out / max(t_in, 1e-9)
    rows = "/".join(str(r) for r in PROBE_ROWS)
    verdict = ">=" if speedup >= MIN_SPEEDUP else "<"
    why = f"auto: x @ W_t {speedup:.2f}x x @ W^T at {rows} rows on this CPU, {verdict} {MIN_SPEEDUP}"
    return LayoutChoice(speedup >= MIN_SPEEDUP, why, measured=True)
