"""Mistral (Mistral 7B, Ministral, fine-tunes): the Llama layout, plus an optional sliding attention window.

HF Mistral names and packs its tensors exactly like Llama (no biases, separate q/k/v, gate/up/down), so the
Llama adapter maps it. `sliding_window=w` lets token i attend to keys j with i - w < j <= i: Megatron's
`window_size=(w - 1, 0)`, which Transformer Engine's attention and our SDPA attention (models/sdpa_attention.py)
both apply. `null` (Mistral v0.2+) is full causal attention.
"""

from __future__ import annotations

from typing import Any

from mcore_rl.models.base import ModelArgs, register_family
from mcore_rl.models.fields import mapped
from mcore_rl.models.llama import LlamaFamily


def _window_check(value: Any, hf: dict[str, Any]) -> str | None:
    if value is None:
        return None
    return None if isinstance(value, int) and value >= 1 else "a window must be a positive number of tokens"


@register_family("MistralForCausalLM")
class MistralFamily(LlamaFamily):
    extra_fields = {"sliding_window": mapped(_window_check)}

    def args(self, hf: dict[str, Any]) -> ModelArgs:
        a = super().args(hf)
        a.sliding_window = hf.get("sliding_window")
        return a
