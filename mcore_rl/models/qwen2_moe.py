"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2 attention (QKV bias) + routed experts + one shared expert.

The shared expert is a dense SwiGLU MLP whose output HF scales by sigmoid(x @ shared_expert_gate) and adds to the
routed experts' output: Megatron's SharedExpertMLP with `moe_shared_expert_gate` computes exactly that, with its
gate weight [1, hidden] = HF's `shared_expert_gate.weight`. Routing and dense layers are Qwen3-MoE's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mcore_rl.models.base import ModelArgs, MoeArgs, register_family
from mcore_rl.models.fields import mapped
from mcore_rl.models.qwen3_moe import Qwen3MoeFamily

Tensor = torch.Tensor
_SHARED = re.compile(
    r"^decoder\.layers\.(\d+)\.mlp\.shared_experts\.(linear_fc1\.weight|linear_fc2\.weight|gate_weight)$"
)


@register_family("Qwen2MoeForCausalLM")
class Qwen2MoeFamily(Qwen3MoeFamily):
    qkv_bias = True
    qk_norm = False
    extra_fields = {
        **Qwen3MoeFamily.extra_fields,
        "shared_expert_intermediate_size": mapped(),
        "qkv_bias": mapped(),  # transformers >= 5 spells the q/k/v bias switch out (True in every release)
    }

    def args(self, hf: dict[str, Any]) -> ModelArgs:
        a = super().args(hf)
        a.qkv_bias = bool(hf.get("qkv_bias", True))
        return a

    def moe_args(self, hf: dict[str, Any]) -> MoeArgs:
        m = super().moe_args(hf)
        m.shared_expert_size = int(hf.get("shared_expert_intermediate_size") or 0)
        m.shared_expert_gate = m.shared_expert_size > 0
        return m

    def shared_expert_names(self, a: ModelArgs, prefix: str) -> list[str]:
        if not a.moe.shared_expert_size:
            return []
        p = prefix + "shared_experts."
        return [p + "linear_fc1.weight", p + "linear_fc2.weight", p + "gate_weight"]

    def hf_sources(self, a: ModelArgs, name: str) -> list[str]:
        m = _SHARED.match(name)
        if m is None:
            return super().hf_sources(a, name)
        hp = f"model.layers.{m.group(1)}.mlp."
        return {
            "linear_fc1.weight": [hp + "shared_expert.gate_proj.weight", hp + "shared_expert.up_proj.weight"],
            "linear_fc2.weight": [hp + "shared_expert.down_proj.weight"],
            "gate_weight": [hp + "shared_expert_gate.weight"],
        }[m.group(2)]

    def to_mcore(self, a: ModelArgs, name: str, get_hf: Callable[[str], Tensor]) -> Tensor:
        if _SHARED.match(name):
            return torch.cat([get_hf(s) for s in self.hf_sources(a, name)], dim=0)  # fc1: [gate; up]
        return super().to_mcore(a, name, get_hf)

    def to_hf(self, a: ModelArgs, name: str, full: Tensor) -> Iterator[tuple[str, Tensor]]:
        if _SHARED.match(name) and name.endswith("linear_fc1.weight"):
            gate_name, up_name = self.hf_sources(a, name)
            gate, up = torch.chunk(full, 2, dim=0)
            yield gate_name, gate.contiguous()
            yield up_name, up.contiguous()
        elif _SHARED.match(name):
            yield self.hf_sources(a, name)[0], full
        else:
            yield from super().to_hf(a, name, full)
