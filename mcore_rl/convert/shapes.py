"""Expected tensor shapes, derived from the HF config alone, so bad inputs fail before any heavy work.

The canonical Megatron shapes below are the only shape knowledge here; the HF shapes are obtained by running the
family's own `to_hf` on meta tensors, so the check can never disagree with the adapter that does the conversion.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from mcore_rl.convert.common import ConvertError
from mcore_rl.models.base import ModelArgs, ModelFamily

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")

# canonical (local-spec) Megatron suffix -> full (TP=1) shape
_SHAPES: dict[str, Callable[[ModelArgs], tuple[int, ...]]] = {
    "embedding.word_embeddings.weight": lambda a: (a.vocab_size, a.hidden_size),
    "output_layer.weight": lambda a: (a.num_labels or a.vocab_size, a.hidden_size),  # a reward model's score head
    "decoder.final_layernorm.weight": lambda a: (a.hidden_size,),
    "input_layernorm.weight": lambda a: (a.hidden_size,),
    "pre_mlp_layernorm.weight": lambda a: (a.hidden_size,),
    "self_attention.linear_qkv.weight": lambda a: (_qkv_rows(a), a.hidden_size),
    "self_attention.linear_qkv.bias": lambda a: (_qkv_rows(a),),
    "self_attention.q_layernorm.weight": lambda a: (a.head_dim,),
    "self_attention.k_layernorm.weight": lambda a: (a.head_dim,),
    "self_attention.linear_proj.weight": lambda a: (a.hidden_size, a.num_attention_heads * a.head_dim),
    "mlp.linear_fc1.weight": lambda a: (2 * a.ffn_hidden_size, a.hidden_size),
    "mlp.linear_fc2.weight": lambda a: (a.hidden_size, a.ffn_hidden_size),
    "self_attention.linear_proj.bias": lambda a: (a.hidden_size,),
    "mlp.linear_fc1.bias": lambda a: (2 * a.ffn_hidden_size,),
    "mlp.linear_fc2.bias": lambda a: (a.hidden_size,),
}
# MoE: the router and each routed expert (global expert index in the name)
_MOE_SHAPES: dict[str, Callable[[ModelArgs], tuple[int, ...]]] = {
    "mlp.router.weight": lambda a: (a.moe.num_experts, a.hidden_size),
    "linear_fc1.weight": lambda a: (2 * a.moe.ffn_hidden_size, a.hidden_size),
    "linear_fc2.weight": lambda a: (a.hidden_size, a.moe.ffn_hidden_size),
    "mlp.shared_experts.linear_fc1.weight": lambda a: (2 * a.moe.shared_expert_size, a.hidden_size),
    "mlp.shared_experts.linear_fc2.weight": lambda a: (a.hidden_size, a.moe.shared_expert_size),
    "mlp.shared_experts.gate_weight": lambda a: (1, a.hidden_size),
}
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
# HF tensors that carry no information a Megatron checkpoint needs
_IGNORABLE_HF = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def _qkv_rows(a: ModelArgs) -> int:
    return (a.num_attention_heads + 2 * a.num_query_groups) * a.head_dim


def split_layer(name: str) -> tuple[int | None, str]:
    """'decoder.layers.7.mlp.linear_fc1.weight' -> (7, 'mlp.linear_fc1.weight'); other names -> (None, name)."""
    m = _LAYER.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def mcore_shape(args: ModelArgs, name: str) -> tuple[int, ...]:
    _, rest = split_layer(name)
    if args.moe is not None:
        m = _EXPERT.match(rest)
        key = m.group(2) if m else rest
        if key in _MOE_SHAPES:
            return _MOE_SHAPES[key](args)
    if rest not in _SHAPES:
        raise ConvertError(f"no shape rule for Megatron tensor {name!r} (architecture {args.architecture})")
    return _SHAPES[rest](args)


def expected_hf_shapes(family: ModelFamily, args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for the whole model, via the family adapter on meta tensors."""
    out: dict[str, tuple[int, ...]] = {}
    for name in family.mcore_names(args):
        meta = torch.empty(mcore_shape(args, name), device="meta")
        for hf_name, t in family.to_hf(args, name, meta):
            out[hf_name] = tuple(t.shape)
    return out


def check_hf_checkpoint(family: ModelFamily, args: ModelArgs, reader) -> list[str]:
    """Every tensor the conversion needs exists with the shape the config implies (headers only, no data).

    Returns the HF tensors the conversion will not use (the caller warns about them).
    """
    expected = expected_hf_shapes(family, args)
    for name, shape in expected.items():
        if name not in reader:
            raise ConvertError(
                f"tensor {name} missing from HF checkpoint {reader.folder} (config expects shape {shape})"
            )
        got = tuple(reader.shape(name))
        if got != shape:
            raise ConvertError(
                f"tensor {name}: HF checkpoint has shape {got}, config.json implies {shape} "
                f"({reader.folder}; do config and weights belong together?)"
            )
    tied_head = {"lm_head.weight"} if args.tie_word_embeddings else set()
    return sorted(n for n in reader.names() if n not in expected and n not in tied_head
                  and not _IGNORABLE_HF.search(n))
