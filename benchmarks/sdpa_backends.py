"""Which fused attention kernel the policy's core attention (`models/sdpa_attention.py`) gets, and what it costs.

    python benchmarks/sdpa_backends.py [--device cuda] [--dtype bf16] [--batch 8] [--seq 1024] [--heads 14]
        [--kv-heads 2] [--head-dim 64] [--iters 10]

Why: `F.scaled_dot_product_attention` silently picks a backend per call, and a GQA call (`enable_gqa=True`) or an
explicit mask can rule the fastest one out, leaving the O(s^2)-memory math kernel with no error. This runs causal
fwd+bwd of one attention layer of the given shape (default: the 0.5B Llama shape of `policy_step.py`) with GQA
native and with K/V expanded to every query head, under each backend forced and under the default choice, side by
side in one process: median ms per call, or the backend's refusal.
"""

from __future__ import annotations

import argparse

from policy_step import bench  # benchmarks/policy_step.py (sys.path[0] is this folder)


def timed(fn, iters: int, sync) -> float:
    """Median ms per call of fn with the device synchronised, after a warm-up."""
    return 1e3 * bench(lambda: (fn(), sync()), iters)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="default: cuda where available")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    g = torch.Generator(device=device).manual_seed(0)

    def rand(heads: int) -> torch.Tensor:
        shape = (a.batch, heads, a.seq, a.head_dim)
        return torch.randn(shape, generator=g, device=device, dtype=dt).requires_grad_()

    q, k, v = rand(a.heads), rand(a.kv_heads), rand(a.kv_heads)
    rep = a.heads // a.kv_heads

    def gqa() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()

    def expanded() -> None:  # what the kernel sees when K/V are repeated per query head first
        ke, ve = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        F.scaled_dot_product_attention(q, ke, ve, is_causal=True).sum().backward()

    backends = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    print(f"device={device} ({name}) dtype={a.dtype} q=[{a.batch}, {a.heads}, {a.seq}, {a.head_dim}] "
          f"kv_heads={a.kv_heads} causal fwd+bwd, median of {a.iters}, torch {torch.__version__}")
    print(f"{'backend':>10} | {'GQA native (ms)':>18} | {'K/V expanded (ms)':>18}")
    for label, backend in backends.items():
        cells = []
        for fn in (gqa, expanded):
            try:
                if backend is None:
                    cells.append(f"{timed(fn, a.iters, sync):18.2f}")
                else:
                    with sdpa_kernel([backend]):
                        cells.append(f"{timed(fn, a.iters, sync):18.2f}")
            except RuntimeError as e:
                cells.append(f"{'refused':>18}")
                print(f"  {label} {'GQA' if fn is gqa else 'expanded'}: {str(e).splitlines()[0][:150]}")
        print(f"{label:>10} | {cells[0]} | {cells[1]}")


if __name__ == "__main__":
    main()
