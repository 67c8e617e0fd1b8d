"""Decode-step attention for the local engine in bf16 / fp16: one query token against the KV cache, as two matmuls.

Why: for a single query token PyTorch's CPU SDPA runs its flash kernel (blocked for long queries) and, profiled on
the engine's bf16 decode step (SmolLM2, 32 rows, ~100 cached tokens), took ~20% of the step (~0.9 ms per layer
call, 1 thread), against ~0.1 ms for the same maths as `q @ k^T -> softmax -> @ v` with the query heads grouped
onto their KV head (GQA without repeating K/V). Prefill (more than one query token) keeps transformers' SDPA.

Scores and softmax are in fp32, probabilities rounded once to the cache dtype for the value matmul. fp32 models
never use this (the engine keeps `sdpa` there, so fp32 outputs stay bitwise as before). Registered under NAME with
transformers' AttentionInterface (and SDPA's mask format), so the model's own attention module calls it.
"""

from __future__ import annotations

import torch

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
    scale = scaling if scaling is not None else dim**-0.5
    q = query.reshape(b, kv_heads, heads // kv_heads, dim)  # query head i reads KV head i // group (repeat_kv)
    scores = torch.matmul(q, key.transpose(-1, -2)).float().mul_(scale)  # [b, kv_heads, group, kv_len]
    if attention_mask is not None:
        mask = attention_mask[:, :, -1:, : key.shape[2]]  # [b, 1, 1, kv_len]
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask.float())
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [b, kv_heads, group, dim]
    return out.reshape(b, 1, heads, dim), None


def register() -> str:
    """Make NAME a transformers attention implementation (idempotent); returns NAME."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, decode_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
