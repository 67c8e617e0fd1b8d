"""bf16 matrix products through fp32 GEMMs, for CPUs without bf16 matrix hardware.

Why: a bf16 GEMM on hardware with bf16 support (AMX, AVX512-BF16, GPU tensor cores) multiplies bf16 inputs,
accumulates in fp32 and rounds the result to bf16 once. A CPU without that hardware runs torch's bf16 `mm` through
a slow emulation: measured 50-61 GFLOP/s against fp32's 227-322 on an AVX-512 Xeon without `avx512_bf16` (~5x),
~1 against 109 on an AVX2-only EPYC (~100x). The same arithmetic is available at fp32 speed: a product of two bf16
values is exact in fp32 (8 + 8 significant bits fit in 24), so widening the inputs, running the fp32 GEMM and
rounding its result to bf16 computes what bf16 hardware computes, up to summation order (which differs between
any two BLAS kernels anyway; measured against the correctly rounded float64 product: 99.98-99.99% of entries
equal, the rest one bf16 ulp off, both for torch's own bf16 kernel and for this path).

So a bf16 run (e.g. an experiment pinned to bf16, or a user matching a GPU run's numerics) can run on such a CPU
at ~0.9x fp32 speed instead of 5-100x slower, with bf16 weights, activations and rounding points unchanged.

How: the CPU kernels of `aten::mm`, `addmm`, `bmm` and `baddbmm` are overridden process-wide (every thread; below
autograd, so backward products go the same way) by functions that widen bf16 operands and call the fp32 kernel;
any other dtype goes to the op's own `.out` kernel, which is not overridden. `disable()` removes the overrides and
restores torch's kernels. Whether to enable is decided by `policy.precision.configure_bf16_matmul`.
"""

from __future__ import annotations

import warnings

import torch

_BF16 = torch.bfloat16
_LIB: torch.library.Library | None = None


def _widen(*tensors: torch.Tensor) -> list[torch.Tensor] | None:
    """fp32 copies when every operand is bf16, else None (the op runs its own kernel)."""
    if all(t.dtype == _BF16 for t in tensors):
        return [t.float() for t in tensors]
    return None


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    wide = _widen(a, b)
    if wide is not None:
        return torch.mm(*wide).to(_BF16)
    return torch.ops.aten.mm.out(a, b, out=a.new_empty((a.shape[0], b.shape[1])))


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    wide = _widen(bias, a, b)
    if wide is not None:  # the bias joins the fp32 accumulator before the one rounding, as in a bf16 GEMM
        return torch.addmm(*wide, beta=beta, alpha=alpha).to(_BF16)
    out = a.new_empty((a.shape[0], b.shape[1]))
    return torch.ops.aten.addmm.out(bias, a, b, beta=beta, alpha=alpha, out=out)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    wide = _widen(a, b)
    if wide is not None:
        return torch.bmm(*wide).to(_BF16)
    return torch.ops.aten.bmm.out(a, b, out=a.new_empty((a.shape[0], a.shape[1], b.shape[2])))


def _baddbmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    wide = _widen(bias, a, b)
    if wide is not None:
        return torch.baddbmm(*wide, beta=beta, alpha=alpha).to(_BF16)
    out = a.new_empty((a.shape[0], a.shape[1], b.shape[2]))
    return torch.ops.aten.baddbmm.out(bias, a, b, beta=beta, alpha=alpha, out=out)


KERNELS = {"mm": _mm, "addmm": _addmm, "bmm": _bmm, "baddbmm": _baddbmm}


def enable() -> None:
    """Route bf16 CPU matrix products through fp32 GEMMs in this process (idempotent)."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": the point of this module
        warnings.simplefilter("ignore", UserWarning)
        for name, fn in KERNELS.items():
            lib.impl(name, fn, "CPU")
    _LIB = lib


def disable() -> None:
    """Back to torch's own kernels."""
    global _LIB
    if _LIB is not None:
        _LIB._destroy()
        _LIB = None


def enabled() -> bool:
    return _LIB is not None
