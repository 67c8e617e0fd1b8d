"""How fast can one decode step's GEMMs be on this CPU, per batch size? The ceiling under the engine's roofline.

    python benchmarks/decode_gemms.py [--dtypes float32,bfloat16] [--rows 1,4,8,16,36,64,256] [--threads 1,2]

The engine's roofline (`benchmarks/rollout_engine.py`) charges a decode step its FLOPs at the square
`torch.mm` 2048^3 rate, or its weight bytes at the read bandwidth, whichever is slower. Decode GEMMs are skinny
(rows = sequences still running, 4-64 in an RL round), and a BLAS reaches neither bound on such shapes. This
prints, for SmolLM2-135M's four layer GEMMs (fused QKV, attention output, fused gate+up, down) as the engine runs
them (`F.linear`), the achieved GFLOP/s and weight-streaming GB/s per row count, next to the square-matmul rate and
the read bandwidth measured in the same run, so a reader can see how much of the roofline the GEMMs alone allow
before the LM head, attention and sampling are counted.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from mcore_rl.rollout.local.roofline import bandwidth_gbs, matmul_gflops

# SmolLM2-135M: hidden 576, 9 query + 3 KV heads of 64, MLP 1536 (out, in) of each layer GEMM
SHAPES = [(576 + 2 * 192, 576), (576, 576), (2 * 1536, 576), (576, 1536)]


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
            for rows in map(int, a.rows.split(",")):
                gflops, gbs = gemm_rate(dtype, rows)
                print(f"  rows {rows:4d}: {gflops:7.1f} GFLOP/s = {100 * gflops / peak:5.1f}% of torch.mm, "
                      f"weights streamed at {gbs:6.1f} GB/s = {100 * gbs / bw:5.1f}% of bandwidth")  # fmt: skip


if __name__ == "__main__":
    main()
