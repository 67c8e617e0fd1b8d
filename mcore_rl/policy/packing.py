"""Packed micro-batches: a micro-batch's rows concatenated without pad tokens, through Megatron's THD layout.

Why: a token-budget micro-batch of right-padded rows spends every matmul on its pad tokens too (rows * longest
row). Packed, the decoder runs on sum(row lengths) tokens: Megatron's `PackedSeqParams(qkv_format="thd")` carries
the sequence boundaries (cu_seqlens); its RoPE restarts positions at each boundary (`_apply_rotary_pos_emb_thd`)
and the local spec's core attention (`models/sdpa_attention.py`) runs causal attention per sequence (on CUDA in one
flash-attention call, `models/varlen.py`). Each row is
cut after its last scored token (causal attention: later tokens cannot change earlier ones).
"""

from __future__ import annotations

import torch

from mcore_rl.compat.rope import PACK_POSITIONS


def can_pack(gpt) -> bool:
    """Packing needs the whole model on this rank (PP stages exchange fixed [seq, batch] shapes), no sequence or
    context parallelism, and the local layer spec's SDPA attention (TE's takes THD through its own kernels)."""
    from mcore_rl.models.sdpa_attention import SdpaAttention

    c = gpt.config
    if not (gpt.pre_process and gpt.post_process) or c.sequence_parallel or c.context_parallel_size != 1:
        return False
    layer = gpt.decoder.layers[0] if len(gpt.decoder.layers) else None
    return layer is not None and isinstance(
        getattr(layer.self_attention, "core_attention", None), SdpaAttention
    )


def row_lengths(loss_mask: torch.Tensor) -> torch.Tensor:
    """Tokens each row needs: up to its last scored token (at least 1), as `PolicyBatch.lengths` on any device."""
    idx = torch.arange(loss_mask.shape[1], device=loss_mask.device).expand_as(loss_mask)
    real = (loss_mask > 0) | (idx == 0)
    return torch.where(real, idx, torch.zeros_like(idx)).amax(dim=1) + 1


def pack_rows(tokens: torch.Tensor, lengths: torch.Tensor):
    """Rows [b, L] cut to `lengths` and concatenated: (tokens [1, T], positions [1, T], PackedSeqParams,
    offsets [b] of each row's first token in the pack)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = lengths.to(torch.int64).clamp(max=tokens.shape[1])
    keep = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0) < lengths.unsqueeze(1)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=tokens.device)
    cu[1:] = torch.cumsum(lengths, 0)
    pos = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)[keep]
    setattr(cu, PACK_POSITIONS, pos)  # RoPE's per-token rows, read on the device (compat/rope.py)
    longest = int(lengths.max())
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )
    return tokens[keep].unsqueeze(0), pos.unsqueeze(0), params, cu[:-1].to(torch.int64)


def scored_rows(hidden: torch.Tensor, offsets: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """Hidden states [T, 1, H] of a pack -> those predicting the scored tokens, [n, H], in the row-major order of
    `sel` [b, L-1] (the padded layout's `hidden.transpose(0, 1)[:, :-1][sel]`)."""
    index = offsets.unsqueeze(1) + torch.arange(sel.shape[1], device=sel.device).unsqueeze(0)
    return hidden[index[sel], 0]
