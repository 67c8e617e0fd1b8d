"""Packed (THD) causal attention in one flash-attention call on CUDA, through PyTorch's own
`torch.nn.attention.varlen.varlen_attn`.

Why: without it, SdpaAttention's packed path runs one SDPA call per sequence of the pack and reads the sequence
bounds on the host in every layer; on an H200 packed rows then ran at 0.3x the padded speed (docs/gpu_checks.md).
PyTorch (>= 2.10) ships flash attention's variable-length kernel: one call per layer for the whole pack, the
bounds read on the device, no pad token computed. No extra package is needed (flash-attn, Transformer Engine).

Where it applies: CUDA tensors in fp16/bf16 (flash attention's dtypes), head dim <= 256, no attention dropout, no
sliding window; elsewhere SdpaAttention runs its per-sequence path (the same maths). The API changed between
releases (2.10: `is_causal=True`; later: `window_size=(-1, 0)`; `enable_gqa` and `scale` are not in every one),
so the call is built from the installed function's own signature, and a release without a causal switch is not
used.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

FLASH_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class VarlenApi:
    fn: Callable[..., Tensor]
    causal: dict  # the keyword that makes the call causal in this release
    gqa_keyword: bool  # `enable_gqa` exists (else K/V heads are repeated up to the query heads)
    scale_keyword: bool


@lru_cache(maxsize=1)
def api() -> VarlenApi | None:
    """The installed `varlen_attn` and how to call it causally, or None where PyTorch has none usable."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return api_of(varlen_attn)


def api_of(fn: Callable[..., Tensor]) -> VarlenApi | None:
    params = inspect.signature(fn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    return VarlenApi(fn, causal, "enable_gqa" in params, "scale" in params)


def applies(query: Tensor, dropout_p: float, window_left: int | None, scale: float) -> bool:
    """True where `packed_causal` computes what the per-sequence SDPA path computes."""
    a = api()
    if a is None or not query.is_cuda or query.dtype not in FLASH_DTYPES or query.shape[-1] > MAX_HEAD_DIM:
        return False
    if dropout_p > 0.0 or window_left is not None:
        return False
    # a release without the `scale` keyword computes the default 1/sqrt(head dim) only
    return a.scale_keyword or abs(scale - query.shape[-1] ** -0.5) < 1e-12


def packed_causal(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                  scale: float, impl: VarlenApi | None = None) -> Tensor:
    """Causal attention within each sequence of a pack: query [T, Hq, D], key/value [T, Hkv, D] -> [T, Hq, D];
    `cu_seqlens` [n + 1] are the sequence bounds (int32 on the device), `max_seqlen` the longest sequence."""
    a = impl or api()
    if a is None:
        raise RuntimeError("varlen attention: this PyTorch has no usable torch.nn.attention.varlen.varlen_attn")
    kw = dict(a.causal)
    if a.scale_keyword:
        kw["scale"] = scale
    if key.shape[1] != query.shape[1]:
        if a.gqa_keyword:
            kw["enable_gqa"] = True
        else:
            rep = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    out = a.fn(query, key, value, cu, cu, int(max_seqlen), int(max_seqlen), **kw)
    return out[0] if isinstance(out, tuple) else out
