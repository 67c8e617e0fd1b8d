"""Qwen2/2.5 (QKV bias) and Qwen3 (per-head QK RMSNorm): Llama layout plus one feature each."""

from __future__ import annotations

from mcore_rl.models.base import register_family
from mcore_rl.models.llama import LlamaFamily


@register_family("Qwen2ForCausalLM")
class Qwen2Family(LlamaFamily):
    qkv_bias = True
    extra_fields = {}  # HF Qwen2 always has q/k/v biases and no other switch


@register_family("Qwen3ForCausalLM")
class Qwen3Family(LlamaFamily):
    qk_norm = True
    extra_fields = {}
