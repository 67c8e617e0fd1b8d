"""Llama family (SmolLM2, Llama-2/3, with optional biases and any activation of models/activations.py): the HF<->Megatron state-dict adapter that Qwen2/Qwen3 reuse.

Megatron names here are the *canonical* (local-spec, TP=1, global layer index) names. Layout differences:
- QKV is one fused matrix, grouped per KV head: for each query group g -> [q heads of g | k_g | v_g].
- SwiGLU gate and up projections are one fused `linear_fc1` = [gate; up].
- Transformer Engine fuses the pre-attention / pre-MLP norms into linear_qkv / linear_fc1 (`te_name`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mcore_rl.models.base import ModelArgs, ModelFamily, register_family
from mcore_rl.models.fields import mapped

Tensor = torch.Tensor
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# canonical Megatron suffix -> HF suffix (per layer) for the one-to-one tensors
_LAYER_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "mlp.linear_fc2.bias": "mlp.down_proj.bias",
}
_FC1 = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")
_TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def te_name(canonical: str) -> str:
    """Canonical (local-spec) name -> Transformer Engine spec name."""
    m = _LAYER.match(canonical)
    if m and m.group(2) in _TE_NAMES:
        return f"decoder.layers.{m.group(1)}.{_TE_NAMES[m.group(2)]}"
    return canonical


def canonical_name(name: str) -> str:
    """Either spec's parameter name -> canonical (local-spec) name."""
    m = _LAYER.match(name)
    if m:
        for local, te in _TE_NAMES.items():
            if m.group(2) == te:
                return f"decoder.layers.{m.group(1)}.{local}"
    return name


def _biases_together(value: Any, hf: dict[str, Any]) -> str | None:
    att, mlp = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if att != mlp:
        return (f"attention_bias={att} and mlp_bias={mlp} must be equal (Megatron's add_bias_linear puts biases on "
                "o_proj and the MLP together)")
    return None


@register_family("LlamaForCausalLM")
class LlamaFamily(ModelFamily):
    # attention_bias: q/k/v/o biases; mlp_bias: gate/up/down biases (Megatron: add_qkv_bias + add_bias_linear)
    extra_fields = {"mlp_bias": mapped(_biases_together), "attention_bias": mapped(_biases_together)}

    def args(self, hf: dict[str, Any]) -> ModelArgs:
        a = super().args(hf)
        if hf.get("attention_bias") and "attention_bias" in self.fields():
            a.qkv_bias = a.linear_bias = True
        return a

    def mcore_names(self, a: ModelArgs) -> list[str]:
        """Every canonical Megatron tensor of the full model, in a streaming-friendly order."""
        names = ["embedding.word_embeddings.weight"]
        for i in range(a.num_layers):
            p = f"decoder.layers.{i}."
            names += [p + "input_layernorm.weight", p + "self_attention.linear_qkv.weight"]
            if a.qkv_bias:
                names.append(p + "self_attention.linear_qkv.bias")
            if a.qk_norm:
                names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
            names += [p + "self_attention.linear_proj.weight", p + "pre_mlp_layernorm.weight",
                      p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
            if a.linear_bias:
                names += [p + "self_attention.linear_proj.bias", p + "mlp.linear_fc1.bias", p + "mlp.linear_fc2.bias"]
        names.append("decoder.final_layernorm.weight")
        if not a.tie_word_embeddings:
            names.append("output_layer.weight")
        return names

    # ---- HF -> Megatron ------------------------------------------------------------------------------------
    def hf_sources(self, a: ModelArgs, name: str) -> list[str]:
        """HF tensor names needed to build one canonical Megatron tensor."""
        if name == "embedding.word_embeddings.weight":
            return ["model.embed_tokens.weight"]
        if name == "decoder.final_layernorm.weight":
            return ["model.norm.weight"]
        if name == "output_layer.weight":
            return ["lm_head.weight"]
        m = _LAYER.match(name)
        if not m:
            raise KeyError(f"no HF mapping for Megatron tensor {name!r}")
        i, rest = m.group(1), m.group(2)
        hp = f"model.layers.{i}."
        if rest in _LAYER_DIRECT:
            return [hp + _LAYER_DIRECT[rest]]
        if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = rest.rsplit(".", 1)[1]
            return [f"{hp}self_attn.{x}_proj.{kind}" for x in "qkv"]
        if rest in _FC1:
            kind = rest.rsplit(".", 1)[1]
            return [f"{hp}mlp.gate_proj.{kind}", f"{hp}mlp.up_proj.{kind}"]
        raise KeyError(f"no HF mapping for Megatron tensor {name!r}")

    def to_mcore(self, a: ModelArgs, name: str, get_hf: Callable[[str], Tensor]) -> Tensor:
        """Build the full canonical Megatron tensor `name` from HF tensors fetched by `get_hf`."""
        srcs = [get_hf(s) for s in self.hf_sources(a, name)]
        if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
            return self._pack_qkv(a, *srcs)
        if name.endswith(_FC1):
            return torch.cat(srcs, dim=0)
        return srcs[0]

    def _pack_qkv(self, a: ModelArgs, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        g, d = a.num_query_groups, a.head_dim
        per = a.num_attention_heads // g
        tail = q.shape[1:]
        q = q.reshape(g, per * d, *tail)
        k = k.reshape(g, d, *tail)
        v = v.reshape(g, d, *tail)
        return torch.cat([q, k, v], dim=1).reshape(g * (per + 2) * d, *tail)

    # ---- Megatron -> HF ------------------------------------------------------------------------------------
    def to_hf(self, a: ModelArgs, name: str, full: Tensor) -> Iterator[tuple[str, Tensor]]:
        """Split one full canonical Megatron tensor into its HF tensors."""
        srcs = self.hf_sources(a, name)
        if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
            g, d = a.num_query_groups, a.head_dim
            per = a.num_attention_heads // g
            tail = full.shape[1:]
            grouped = full.reshape(g, (per + 2) * d, *tail)
            q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
            for hf_name, t in zip(srcs, (q, k, v)):
                yield hf_name, t.reshape(-1, *tail).contiguous()
        elif name.endswith(_FC1):
            gate, up = torch.chunk(full, 2, dim=0)
            yield srcs[0], gate.contiguous()
            yield srcs[1], up.contiguous()
        else:
            yield srcs[0], full
