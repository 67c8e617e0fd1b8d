"""Model-family registry: HF config -> Megatron TransformerConfig + layer spec, and the HF<->Megatron adapter.

Why one adapter per family: the same name/layout mapping serves checkpoint conversion, policy initialisation from
HF weights and weight sync to rollout engines, so a mapping bug shows up everywhere at once and one
logits-equality test guards all three.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mcore_rl.models.fields import COMMON_FIELDS, DECODER_FIELDS, Field, check_fields
from mcore_rl.models.rope import RopeArgs, rope_args
from mcore_rl.registry import Registry

_PKG = "mcore_rl.models"
FAMILIES: Registry[type[ModelFamily]] = Registry("architecture", {
    "LlamaForCausalLM": f"{_PKG}.llama", "Qwen2ForCausalLM": f"{_PKG}.qwen", "Qwen3ForCausalLM": f"{_PKG}.qwen",
    "Qwen3MoeForCausalLM": f"{_PKG}.qwen3_moe", "Qwen2MoeForCausalLM": f"{_PKG}.qwen2_moe",
    "MistralForCausalLM": f"{_PKG}.mistral",
})  # fmt: skip
# HF configs without `architectures` name their family by `model_type` only
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                "mistral": "MistralForCausalLM"}


def register_family(*architectures: str) -> Callable[[type[ModelFamily]], type[ModelFamily]]:
    """Class decorator: the adapter for HF configs whose `architectures` name one of `architectures`."""

    def deco(cls: type[ModelFamily]) -> type[ModelFamily]:
        cls.architectures = tuple(architectures)
        for arch in architectures:
            FAMILIES.register(arch)(cls)
        return cls

    return deco


def supported_architectures() -> list[str]:
    return FAMILIES.names()


@dataclass
class MoeArgs:
    """Mixture-of-Experts facts: which decoder layers route, and the routed/shared experts' shapes."""

    num_experts: int
    topk: int
    ffn_hidden_size: int  # per routed expert
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1 (HF `norm_topk_prob`)
    shared_expert_size: int = 0  # 0 = no shared expert
    shared_expert_gate: bool = False  # shared expert output scaled by sigmoid(x @ gate) (Qwen2-MoE)
    dense_layers: tuple[int, ...] = ()  # layers whose MLP is a plain dense MLP (HF mlp_only_layers / sparse step)

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers


@dataclass
class ModelArgs:
    """Architecture facts read from an HF config, in our own names (one place for HF key spellings)."""

    architecture: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    linear_bias: bool = False  # biases on every other linear too: o_proj, gate/up/down (Megatron add_bias_linear)
    activation: str = "silu"  # HF hidden_act (models/activations.py)
    rope: RopeArgs = field(default_factory=RopeArgs)  # rotary type and parameters (frequencies, attention factor)
    moe: MoeArgs | None = None  # Mixture-of-Experts MLPs (None = dense)
    sliding_window: int | None = None  # attend to the last `sliding_window` tokens only (None = full causal)
    window_layers: tuple[int, ...] | None = None  # the windowed layers when only some are (None = all of them)
    # 0: a causal LM; > 0: a sequence classifier (models/seq_cls.py) whose output layer is its score head
    # [num_labels, hidden] instead of the LM head
    num_labels: int = 0
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)


def read_hf_config(path_or_dict: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(path_or_dict, dict):
        return dict(path_or_dict)
    p = Path(path_or_dict)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"HF config not found: {p} (expected an HF model folder with config.json)")
    return json.loads(p.read_text())


def family_for(hf_config: dict[str, Any]) -> ModelFamily:
    """The adapter for `hf_config`; only its family's module is imported."""
    archs = hf_config.get("architectures") or []
    if not archs and hf_config.get("model_type") in _MODEL_TYPES:
        archs = [_MODEL_TYPES[hf_config["model_type"]]]
    for arch in archs:
        if arch in FAMILIES:
            return FAMILIES.get(arch)()
    raise ValueError(
        f"unsupported architecture {archs or hf_config.get('model_type')!r}; supported: "
        f"{', '.join(supported_architectures())}"
    )


class ModelFamily:
    """Base family: subclasses declare which HF features they have and may override the mapping."""

    architectures: tuple[str, ...] = ()
    qkv_bias: bool = False
    qk_norm: bool = False
    # HF config fields this family understands beyond the common decoder ones (see models/fields.py)
    extra_fields: dict[str, Field] = {}

    def fields(self) -> dict[str, Field]:
        """The full declaration: every HF config field this adapter maps, ignores as harmless, or pins."""
        return {**COMMON_FIELDS, **DECODER_FIELDS, **self.extra_fields}

    def check_config(self, hf: dict[str, Any]) -> None:
        """Refuse (one line) any field outside the declaration or at a value the adapter does not implement."""
        check_fields((hf.get("architectures") or [self.architectures[0]])[0], hf, self.fields())

    def moe_args(self, hf: dict[str, Any]) -> MoeArgs | None:
        return None

    def args(self, hf: dict[str, Any]) -> ModelArgs:
        self.check_config(hf)
        heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        rope = rope_args(hf)
        return ModelArgs(
            architecture=(hf.get("architectures") or [self.architectures[0]])[0],
            num_layers=hf["num_hidden_layers"],
            hidden_size=hidden,
            ffn_hidden_size=hf["intermediate_size"],
            num_attention_heads=heads,
            num_query_groups=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            vocab_size=hf["vocab_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope.theta,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=self.qkv_bias,
            qk_norm=self.qk_norm,
            activation=hf.get("hidden_act", "silu"),
            rope=rope,
            moe=self.moe_args(hf),
            hf_config=hf,
        )
