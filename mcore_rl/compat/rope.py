"""Megatron's unfused RoPE without its per-layer waste; bitwise the same result.

Why: without Transformer Engine's fused kernel, Megatron applies rotary embeddings per layer as
`cos(freqs)`, `sin(freqs)`, two casts, `t * cos + rotate_half(t) * sin`, then `cat((t, t_pass))` even when
`t_pass` is empty (a full copy of q and k). `freqs` is the same tensor for every layer of one forward pass, so
cos/sin are recomputed 2 x num_layers times. In a bf16 fwd+bwd on CPU these element-wise ops cost more than the
attention itself (profile in docs/performance.md). Here cos/sin are cached per `freqs` tensor (checked by identity
and version) and the empty-`t_pass` concatenation is skipped; the arithmetic is Megatron's, operation for
operation, so results are identical (fp32; bf16/fp16 go through the compiled `fused_ops.rope`, same formula
rounded once). Anything else (packed sequences, interleaved or MLA rotary, partial rotary,
fused RoPE) goes to Megatron's own function.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

_INSTALLED = False
_CACHE: dict[tuple, tuple] = {}
_MAX_ENTRIES = 8


def _cos_sin(freqs: Tensor, dtype: torch.dtype, mscale: float) -> tuple[Tensor, Tensor]:
    key = (id(freqs), dtype, mscale)
    hit = _CACHE.get(key)
    if hit is not None:
        ref, version, cos_, sin_ = hit
        if ref() is freqs and version == freqs._version:
            return cos_, sin_
    cos_ = (torch.cos(freqs) * mscale).to(dtype)
    sin_ = (torch.sin(freqs) * mscale).to(dtype)
    if len(_CACHE) >= _MAX_ENTRIES:
        _CACHE.clear()
    _CACHE[key] = (weakref.ref(freqs), freqs._version, cos_, sin_)
    return cos_, sin_


def install() -> None:
    """Route `megatron.core.transformer.attention.apply_rotary_pos_emb` through the cached path (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from megatron.core.transformer import attention

    original = attention.apply_rotary_pos_emb

    def apply_rotary_pos_emb(t: Tensor, freqs: Tensor, config, cu_seqlens: Tensor | None = None,
                             mscale: float = 1.0, cp_group=None) -> Tensor:
        if (cu_seqlens is not None or config.apply_rope_fusion or config.rotary_interleaved
                or config.multi_latent_attention or freqs.shape[-1] != t.shape[-1] or freqs.requires_grad):
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
        cos_, sin_ = _cos_sin(freqs, t.dtype, mscale)
        if t.dtype != torch.float32:  # bf16/fp16: one compiled loop fwd and bwd (compat/fused_ops.py)
            from mcore_rl.compat.fused_ops import compile_enabled, rope

            if compile_enabled():
                return rope(t, cos_, sin_)
        x1, x2 = torch.chunk(t, 2, dim=-1)
        return (t * cos_) + (torch.cat((-x2, x1), dim=-1) * sin_)

    apply_rotary_pos_emb.__wrapped__ = original  # type: ignore[attr-defined]
    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
    _INSTALLED = True
