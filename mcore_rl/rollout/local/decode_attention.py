"""Decode-step attention for the local engine: one query token per row against the KV cache, GQA packed.

Why: transformers' SDPA path hands PyTorch's CPU flash kernel one query row per attention head (enable_gqa), and
for a single query token that kernel's per-(row, head) overhead dominates: profiled on the engine's bf16 decode
step (SmolLM2, 32 rows, 9 query / 3 KV heads, ~100 cached tokens, 1 thread) ~2.3 ms of CPU per layer call, against
~0.4 ms when the 3 query heads that share a KV head are passed as 3 query rows of one KV head (transformers'
`pack_gqa` idea). Same kernel and maths, no K/V repeat or copy (a plain `q @ k^T` would copy the cache views:
CPU bmm wants contiguous batches, and the cache is a slice of a growing buffer). Measured bitwise equal to the
SDPA path in fp32 and bf16 (tests/rollout/test_engine_bf16.py), so it is on for every dtype. Prefill (more than one
query token) keeps transformers' SDPA. Registered under NAME with transformers' AttentionInterface (and SDPA's
mask format), so the model's own attention modules call it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "mcore_rl_decode"


def decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns [batch, q_len, heads, head_dim] like its SDPA."""
    b, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if q_len != 1 or heads % kv_heads or kwargs.get("output_attentions") or kwargs.get("softcap") is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    q = query.reshape(b, kv_heads, heads // kv_heads, dim)  # query head i reads KV head i // group (repeat_kv)
    mask = None if attention_mask is None else attention_mask[:, :, -1:, : key.shape[2]]  # [b, 1, 1, kv_len]
    # the group's query heads stand in SDPA's query-length slot: one [group, kv_len] score block per KV head;
    # never is_causal (those rows are heads, not positions). Same kernel, same maths, no K/V repeat or copy.
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)  # [b, kv_heads, group, dim]
    return out.reshape(b, 1, heads, dim), None


def register() -> str:
    """Make NAME a transformers attention implementation (idempotent); returns NAME."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, decode_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
