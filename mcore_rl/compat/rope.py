"""Megatron's unfused RoPE without its per-layer waste; bitwise the same result.

Why: without Transformer Engine's fused kernel, Megatron applies rotary embeddings per layer as
`cos(freqs)`, `sin(freqs)`, two casts, `t * cos + rotate_half(t) * sin`, then `cat((t, t_pass))` even when
`t_pass` is empty (a full copy of q and k). `freqs` is the same tensor for every layer of one forward pass, so
cos/sin are recomputed 2 x num_layers times. In a bf16 fwd+bwd on CPU these element-wise ops cost more than the
attention itself (profile in docs/performance.md). Here cos/sin are cached per `freqs` tensor (checked by identity
and version) and the empty-`t_pass` concatenation is skipped; the arithmetic is Megatron's, operation for
operation, so results are identical (fp32; bf16/fp16 go through the compiled `fused_ops.rope`, same formula
rounded once). Packed (THD) micro-batches built by `policy/packing.pack_rows` take the same path: their
`cu_seqlens` carry each token's position within its sequence (`PACK_POSITIONS`), so the per-token cos/sin are one
gather, cached for the whole forward pass, where Megatron reads the sequence lengths on the host and slices and
concatenates its frequencies per sequence in every layer (a device sync per layer on a GPU). Anything else
(packs from elsewhere, context parallelism, interleaved or MLA rotary, partial rotary, fused RoPE) goes to
Megatron's own function.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

_INSTALLED = False
_CACHE: dict[tuple, tuple] = {}
_MAX_ENTRIES = 8
PACK_POSITIONS = "mcore_rl_pack_positions"  # attribute of a pack's cu_seqlens: [T] positions within each sequence


def _cos_sin(freqs: Tensor, dtype: torch.dtype, mscale: float, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """cos/sin of `freqs` (of its `rows` when given: a gather of the same values), cached per tensor identity."""
    key = (id(freqs), id(rows), dtype, mscale)
    hit = _CACHE.get(key)
    if hit is not None:
        (freqs_ref, rows_ref), versions, cos_, sin_ = hit
        if freqs_ref() is freqs and rows_ref() is rows and versions == _versions(freqs, rows):
            return cos_, sin_
    if rows is not None:
        cos_, sin_ = _cos_sin(freqs, dtype, mscale)
        cos_, sin_ = cos_[rows], sin_[rows]
    else:
        cos_ = (torch.cos(freqs) * mscale).to(dtype)
        sin_ = (torch.sin(freqs) * mscale).to(dtype)
    if len(_CACHE) >= _MAX_ENTRIES:
        _CACHE.clear()
    refs = (weakref.ref(freqs), (lambda: None) if rows is None else weakref.ref(rows))
    _CACHE[key] = (refs, _versions(freqs, rows), cos_, sin_)
    return cos_, sin_


def _versions(freqs: Tensor, rows: Tensor | None) -> tuple[int, int]:
    return freqs._version, -1 if rows is None else rows._version


def _rotate(t: Tensor, cos_: Tensor, sin_: Tensor) -> Tensor:
    """Megatron's `t * cos + rotate_half(t) * sin` (bf16/fp16: the compiled loop where compiling is on)."""
    if t.dtype != torch.float32:  # one compiled loop fwd and bwd (compat/fused_ops.py)
        from mcore_rl.compat.fused_ops import compile_enabled, rope

        if compile_enabled():
            return rope(t, cos_, sin_)
    x1, x2 = torch.chunk(t, 2, dim=-1)
    return (t * cos_) + (torch.cat((-x2, x1), dim=-1) * sin_)


def _pack_rows(t: Tensor, cu_seqlens: Tensor, cp_group) -> Tensor | None:
    """Each packed token's position within its sequence, for a pack built by `pack_rows` without context
    parallelism (the rows of `freqs` Megatron's `_apply_rotary_pos_emb_thd` picks, unless `freqs` has one row per
    packed token: its exact-offset case, handled by the caller). None: not ours to handle."""
    positions = getattr(cu_seqlens, PACK_POSITIONS, None)
    if positions is None or (cp_group is not None and cp_group.size() != 1):
        return None
    if positions.shape[0] != t.shape[0]:
        raise ValueError(f"packed RoPE: {positions.shape[0]} pack positions for {t.shape[0]} tokens")
    return positions


def install() -> None:
    """Route `megatron.core.transformer.attention.apply_rotary_pos_emb` through the cached path (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from megatron.core.transformer import attention

    original = attention.apply_rotary_pos_emb

    def apply_rotary_pos_emb(t: Tensor, freqs: Tensor, config, cu_seqlens: Tensor | None = None,
                             mscale: float = 1.0, cp_group=None) -> Tensor:
        rows = None if cu_seqlens is None else _pack_rows(t, cu_seqlens, cp_group)
        if ((cu_seqlens is not None and rows is None) or config.apply_rope_fusion or config.rotary_interleaved
                or config.multi_latent_attention or freqs.shape[-1] != t.shape[-1] or freqs.requires_grad):
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
        if rows is None:
            return _rotate(t, *_cos_sin(freqs, t.dtype, mscale))
        # THD: t [T, heads, dim] as [T, 1, heads, dim] against per-token cos/sin [T, 1, 1, dim]
        exact_offsets = freqs.shape[0] == t.shape[0]
        cos_, sin_ = _cos_sin(freqs, t.dtype, mscale, None if exact_offsets else rows)
        return _rotate(t.unsqueeze(1), cos_, sin_).squeeze(1)

    apply_rotary_pos_emb.__wrapped__ = original  # type: ignore[attr-defined]
    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
    _INSTALLED = True
