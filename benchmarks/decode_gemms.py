"""How fast can one decode step's GEMMs be on this CPU, per batch size? The ceiling under the engine's roofline.

    python benchmarks/decode_gemms.py [--dtypes float32,bfloat16] [--rows 1,4,8,16,36,64,256] [--threads 1,2]
    python benchmarks/decode_gemms.py --streamed [--rows 4,16,36,64]   # a whole step's GEMMs, weights from memory

The engine's roofline (`benchmarks/rollout_engine.py`) charges a decode step its FLOPs at the square
`torch.mm` 2048^3 rate, or its weight bytes at the read bandwidth, whichever is slower. Decode GEMMs are skinny
(rows = sequences still running, 4-64 in an RL round), and a BLAS reaches neither bound on such shapes. This
prints, for SmolLM2-135M's four layer GEMMs (fused QKV, attention output, fused gate+up, down) as the engine runs
them (`F.linear`), the achieved GFLOP/s and weight-streaming GB/s per row count, next to the square-matmul rate and
the read bandwidth measured in the same run, so a reader can see how much of the roofline the GEMMs alone allow
before the LM head, attention and sampling are counted.

One layer's weights (~1.7 MB in fp32) stay in the caches, a real step's do not (SmolLM2: 538 MB per step).
`--streamed` times what a step runs: 30 layers of distinct weights plus the 49152 x 576 LM head, in both of the
engine's layouts (`rollout.weight_layout`: [out, in] through `decode_forward.linear` with the regrouped head, and
[in, out] as `x @ W_t` with the plain head, lm_head.py), and the head alone in both forms, so the ceiling
and the layout/head choice are read from the same run.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from mcore_rl.rollout.local.decode_forward import linear
from mcore_rl.rollout.local.lm_head import head_logits
from mcore_rl.rollout.local.roofline import bandwidth_gbs, matmul_gflops

# SmolLM2-135M: hidden 576, 9 query + 3 KV heads of 64, MLP 1536 (out, in) of each layer GEMM
SHAPES = [(576 + 2 * 192, 576), (576, 576), (2 * 1536, 576), (576, 1536)]
LAYERS, VOCAB = 30, 49152


def best_ms(fn, before=None, repeats: int = 7) -> float:
    """Best-of wall-clock ms of fn(); `before` (untimed) runs ahead of every call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def _step(xs: dict, layers: list, head: torch.Tensor, in_major: bool) -> None:
    """One step's GEMMs as the engine runs them in either layout (the LM head's form goes with it, lm_head.py)."""
    for ws in layers:
        for w in ws:
            torch.mm(xs[w.shape[0]], w) if in_major else linear(xs[w.shape[1]], w, None)
    head_logits(xs[576], head, regroup=not in_major)


def streamed(dtype: torch.dtype, rows_list: list[int], peak: float) -> None:
    """A decode step's GEMMs with every weight read from memory, per layout; ms and GFLOP/s per row count, and
    the LM head alone in both forms with the caches flushed (a 256 MB read) before each call."""
    layers = [[torch.randn(o, i, dtype=dtype) for o, i in SHAPES] for _ in range(LAYERS)]
    layers_t = [[w.t().contiguous() for w in ws] for ws in layers]
    head = torch.randn(VOCAB, 576, dtype=dtype)
    flush = torch.ones(64 << 20)
    for rows in rows_list:
        xs = {i: torch.randn(rows, i, dtype=dtype) for _, i in SHAPES}
        flop = 2 * rows * (LAYERS * sum(o * i for o, i in SHAPES) + VOCAB * 576)
        t_out = best_ms(lambda: _step(xs, layers, head, False))  # noqa: B023 (called before xs changes)
        t_in = best_ms(lambda: _step(xs, layers_t, head, True))  # noqa: B023
        h_re = best_ms(lambda: head_logits(xs[576], head, regroup=True), flush.sum)  # noqa: B023
        h_plain = best_ms(lambda: F.linear(xs[576], head), flush.sum)  # noqa: B023
        print(f"  rows {rows:4d}: step [out, in] {t_out:6.1f} ms ({flop / t_out / 1e6:6.1f} GFLOP/s), [in, out] "
              f"{t_in:6.1f} ms ({flop / t_in / 1e6:6.1f} GFLOP/s = {100 * flop / t_in / 1e6 / peak:4.1f}% of "
              f"torch.mm); LM head regrouped {h_re:5.1f} ms, plain {h_plain:5.1f} ms")  # fmt: skip


def gemm_rate(dtype: torch.dtype, rows: int, repeats: int = 5, calls: int = 10) -> tuple[float, float]:
    """(GFLOP/s, weight GB/s) of one layer's four GEMMs at `rows`, best of `repeats`."""
    weights = [torch.randn(o, i, dtype=dtype) for o, i in SHAPES]
    inputs = {i: torch.randn(rows, i, dtype=dtype) for _, i in SHAPES}
    for w in weights:  # warm-up: BLAS / oneDNN kernel selection
        F.linear(inputs[w.shape[1]], w)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            for w in weights:
                F.linear(inputs[w.shape[1]], w)
        best = min(best, (time.perf_counter() - t) / calls)
    flop = sum(2 * rows * o * i for o, i in SHAPES)
    nbytes = sum(o * i for o, i in SHAPES) * weights[0].element_size()
    return flop / best / 1e9, nbytes / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--rows", default="1,4,8,16,36,64,256")
    p.add_argument("--threads", default=str(torch.get_num_threads()))
    p.add_argument("--streamed", action="store_true", help="whole steps, weights from memory (see above)")
    a = p.parse_args()
    torch.set_grad_enabled(False)
    cpu = torch.device("cpu")
    for threads in map(int, a.threads.split(",")):
        torch.set_num_threads(threads)
        bw = bandwidth_gbs(cpu).wall
        for name in a.dtypes.split(","):
            dtype = getattr(torch, name)
            peak = matmul_gflops(cpu, dtype).wall
            print(f"threads={threads} {name}: torch.mm 2048^3 {peak:.1f} GFLOP/s, read bandwidth {bw:.1f} GB/s")
            if a.streamed:
                streamed(dtype, [int(r) for r in a.rows.split(",")], peak)
                continue
            for rows in map(int, a.rows.split(",")):
                gflops, gbs = gemm_rate(dtype, rows)
                print(f"  rows {rows:4d}: {gflops:7.1f} GFLOP/s = {100 * gflops / peak:5.1f}% of torch.mm, "
                      f"weights streamed at {gbs:6.1f} GB/s = {100 * gbs / bw:5.1f}% of bandwidth")  # fmt: skip


if __name__ == "__main__":
    main()
