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

`WideWeights` + `wide_linear`: the same products for a caller that multiplies the same weights again and again by a
few rows (the engine's decode step), with each weight widened once per version instead of once per product.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

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
        return _mm(*wide).to(_BF16)  # straight to the fp32 `.out` kernel below
    return torch.ops.aten.mm.out(a, b, out=a.new_empty((a.shape[0], b.shape[1])))


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    wide = _widen(bias, a, b)
    if wide is not None:  # the bias joins the fp32 accumulator before the one rounding, as in a bf16 GEMM
        return _addmm(*wide, beta=beta, alpha=alpha).to(_BF16)
    out = a.new_empty((a.shape[0], b.shape[1]))
    return torch.ops.aten.addmm.out(bias, a, b, beta=beta, alpha=alpha, out=out)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    wide = _widen(a, b)
    if wide is not None:
        return _bmm(*wide).to(_BF16)
    return torch.ops.aten.bmm.out(a, b, out=a.new_empty((a.shape[0], a.shape[1], b.shape[2])))


def _baddbmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    wide = _widen(bias, a, b)
    if wide is not None:
        return _baddbmm(*wide, beta=beta, alpha=alpha).to(_BF16)
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


def routed(x: torch.Tensor) -> bool:
    """True when products of this tensor's dtype and device run through fp32 GEMMs in this process."""
    return _LIB is not None and x.dtype == _BF16 and x.device.type == "cpu"


class WideWeights:
    """fp32 copies of bf16 weights, each made once per weight version. Why: the route widens both operands of every
    product, so a decode step (a few rows times every weight of the model) would re-widen all weights each step:
    SmolLM2 is 135M values, read 2 bytes and written 4 each, for GEMMs of 4-64 rows. A copy is reused while its
    weight's version counter (`Tensor._version`, bumped by every in-place update, shared by views) is unchanged.
    Keyed by the weight object itself, which the cache holds: `clear` when the weights are re-allocated or updated
    through other tensors than these (a view made by `param.data = buf[...]` does not share `buf`'s counter), or
    give a `capacity` (a new weight object beyond it empties the cache: e.g. one slot for a re-pointed LM head)."""

    def __init__(self, capacity: int | None = None) -> None:
        self._copies: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self.capacity = capacity

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        hit = self._copies.get(id(weight))
        if hit is not None and hit[1] == weight._version:
            return hit[2]
        if hit is None and self.capacity is not None and len(self._copies) >= self.capacity:
            self._copies.clear()
        wide = weight.detach().float()
        self._copies[id(weight)] = (weight, weight._version, wide)
        return wide

    def clear(self) -> None:
        self._copies.clear()

    def __len__(self) -> int:
        return len(self._copies)


def wide_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, wide: WideWeights,
                in_major: bool = False) -> torch.Tensor:
    """`F.linear(x, weight, bias)` ([out, in] weight) or `x @ weight (+ bias)` (in_major: [in, out]) of bf16
    operands, as the route computes it (the same fp32 GEMM on the same values, so the same bits), on cached
    widened weights."""
    x32, w32 = x.float(), wide(weight)
    b32 = None if bias is None else wide(bias)
    if not in_major:
        out = F.linear(x32, w32, b32)
    else:
        out = torch.mm(x32, w32) if b32 is None else torch.addmm(b32, x32, w32)
    return out.to(x.dtype)
