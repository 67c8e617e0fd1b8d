"""Qwen2/2.5 (QKV bias) and Qwen3 (per-head QK RMSNorm): Llama layout plus one feature each, and both with
transformers' per-layer sliding windows (models/windows.py)."""

from __future__ import annotations

from typing import Any

from mcore_rl.models.base import ModelArgs, register_family
from mcore_rl.models.llama import LlamaFamily
from mcore_rl.models.windows import WINDOW_FIELDS, window_layers


class _WindowedFamily(LlamaFamily):
    """Reads `use_sliding_window` / `max_window_layers` / `layer_types` into per-layer windows. Subclasses that
    do not declare WINDOW_FIELDS (the MoE families) refuse `use_sliding_window=true` in check_config first."""

    def args(self, hf: dict[str, Any]) -> ModelArgs:
        a = super().args(hf)
        a.sliding_window, a.window_layers = window_layers(hf)
        return a


@register_family("Qwen2ForCausalLM")
class Qwen2Family(_WindowedFamily):
    qkv_bias = True
    extra_fields = {**WINDOW_FIELDS}  # HF Qwen2 always has q/k/v biases; its other switches are the windows


@register_family("Qwen3ForCausalLM")
class Qwen3Family(_WindowedFamily):
    qk_norm = True
    extra_fields = {**WINDOW_FIELDS}
