"""Core attention through `torch.nn.functional.scaled_dot_product_attention`, a drop-in for Megatron's local
`DotProductAttention`.

Why: Megatron's local attention is unfused: it materialises GQA-expanded K/V (`repeat_interleave`), builds a
[b, heads, s, s] score tensor with `baddbmm`, allocates a causal mask per layer and runs a separate softmax and
`bmm`. On CPU (and on GPUs without Transformer Engine) PyTorch's SDPA does the same maths in one fused, blocked
kernel with native GQA and an implicit causal mask: less memory traffic, no s x s buffer kept for backward.
The projections, RoPE and TP sharding around it stay Megatron's; only the softmax(QK^T)V core changes. A
causal sliding window (`window_size=(left, 0)`, Mistral) becomes an explicit boolean mask.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from mcore_rl.models import varlen


def _base():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class SdpaAttention(_base()):  # type: ignore[misc]
    """Same constructor and forward signature as Megatron's DotProductAttention (inputs [s, b, heads, dim])."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None) -> None:
        super().__init__(config=config)
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.utils import divide

        if config.context_parallel_size != 1:
            raise ValueError("SdpaAttention: context parallelism needs Transformer Engine attention")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError("SdpaAttention: only vanilla softmax is supported")
        from megatron.core.transformer.utils import is_layer_window_attention

        window = getattr(config, "window_size", None)
        if window is not None and (window[1] != 0 or window[0] < 0):
            raise ValueError(f"SdpaAttention: window_size={window} (only (left >= 0, 0): causal sliding window)")
        # per layer, as Megatron's and TE's attentions decide it (window_attn_skip_freq; layer_number is global)
        windowed = is_layer_window_attention(window, getattr(config, "window_attn_skip_freq", None), layer_number)
        self.window_left = window[0] if windowed else None
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.attn_mask_type = attn_mask_type
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        head_dim = config.kv_channels
        self.hidden_size_per_partition = self.heads * head_dim
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type=None, attention_bias: Tensor | None = None, packed_seq_params=None) -> Tensor:
        from megatron.core.transformer.enums import AttnMaskType

        if attention_bias is not None:
            raise ValueError("SdpaAttention: attention bias needs Transformer Engine attention")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        sq, b = query.shape[0], query.shape[1]
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        causal = mask_type == AttnMaskType.causal and attention_mask is None
        mask = None
        if attention_mask is not None:  # Megatron masks are True where attention is NOT allowed
            mask = ~attention_mask.bool()
        if self.window_left is not None and query.shape[0] > 1:
            mask = self._window_mask(sq, key.shape[0], query.device, mask)
            causal = False
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=causal and sq > 1, scale=self.softmax_scale, enable_gqa=self.groups != self.heads,
        )
        # [b, n, s, d] -> [s, b, n*d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, params) -> Tensor:
        """THD layout (Megatron squeezed the batch dim: [tokens, heads, dim]): causal attention within each
        sequence of the pack: on CUDA in one flash-attention call where it applies (varlen.py), else one SDPA call
        per sequence; either way no pack-sized mask and no cross-sequence work."""
        if params.qkv_format != "thd" or params.cu_seqlens_q_padded is not None:
            raise ValueError("SdpaAttention: packed sequences must be 'thd' without per-sequence padding")
        dropout = self.dropout_p if self.training else 0.0
        if varlen.applies(query, dropout, self.window_left, self.softmax_scale):  # CUDA: one flash call (varlen.py)
            out = varlen.packed_causal(query, key, value, params.cu_seqlens_q, params.max_seqlen_q,
                                       self.softmax_scale)
            return out.reshape(query.shape[0], self.hidden_size_per_partition)
        bounds = params.cu_seqlens_q.tolist()
        outs = []
        for s, e in zip(bounds[:-1], bounds[1:]):
            q, k, v = (t[s:e].transpose(0, 1).unsqueeze(0) for t in (query, key, value))  # [1, n, len, d]
            mask = self._window_mask(e - s, e - s, query.device, None) if self.window_left is not None else None
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None and e - s > 1,
                scale=self.softmax_scale, enable_gqa=self.groups != self.heads,
            )
            outs.append(out.squeeze(0).transpose(0, 1))
        return torch.cat(outs).reshape(query.shape[0], self.hidden_size_per_partition)

    def _window_mask(self, sq: int, sk: int, device, mask: Tensor | None) -> Tensor:
        """Allowed where key j is among the `window_left + 1` latest keys up to query i (queries are the last sq
        of sk positions); combined with Megatron's own mask when there is one."""
        i = torch.arange(sk - sq, sk, device=device).unsqueeze(1)
        j = torch.arange(sk, device=device).unsqueeze(0)
        allowed = (j <= i) & (i - j <= self.window_left)
        return allowed if mask is None else mask & allowed

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        return {}  # no parameters (vanilla softmax), like DotProductAttention


def use_sdpa(spec):
    """Swap the core attention of a local-spec TransformerLayer spec for SdpaAttention, in place."""
    spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    return spec
