"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention + a routed Mixture-of-Experts MLP in every layer.

Megatron side (local spec, SequentialMLP experts): `mlp.router.weight` [E, H] and per expert
`mlp.experts.local_experts.<e>.linear_fc1.weight` = [gate_e; up_e] and `linear_fc2.weight` = down_e. Canonical names
carry the *global* expert index; under expert parallelism each rank holds a contiguous block of experts
(policy/hf_weights.py translates). HF checkpoint side: `mlp.gate.weight` and `mlp.experts.<e>.{gate,up,down}_proj`.

Router math: HF takes softmax over all experts, picks the top-k, and with `norm_topk_prob` renormalises them; that is
exactly Megatron's softmax over the top-k logits (`moe_router_pre_softmax=False`). Without `norm_topk_prob` HF keeps
the raw top-k probabilities: Megatron's `moe_router_pre_softmax=True`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mcore_rl.models.base import ModelArgs, MoeArgs, register_family
from mcore_rl.models.fields import fixed, harmless, mapped
from mcore_rl.models.qwen import Qwen3Family

Tensor = torch.Tensor
_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_ROUTER = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.router\.weight$")


def _all_layers_sparse(value: Any, hf: dict[str, Any]) -> str | None:
    return f"dense layers {value} among MoE layers are not implemented" if value else None


@register_family("Qwen3MoeForCausalLM")
class Qwen3MoeFamily(Qwen3Family):
    extra_fields = {
        "num_experts": mapped(),
        "num_local_experts": mapped(),  # transformers >= 5 spells num_experts this way in config.json
        "num_experts_per_tok": mapped(),
        "moe_intermediate_size": mapped(),
        "norm_topk_prob": mapped(),
        "decoder_sparse_step": fixed(1, why="every layer is an MoE layer"),
        "mlp_only_layers": mapped(_all_layers_sparse),
        "router_aux_loss_coef": harmless("a training-loss weight; ours is model.moe.aux_loss_coeff"),
        "output_router_logits": harmless("inference output switch"),
    }

    def moe_args(self, hf: dict[str, Any]) -> MoeArgs:
        n = hf.get("num_experts", hf.get("num_local_experts"))
        if not n:
            raise ValueError("Qwen3MoeForCausalLM config has no num_experts / num_local_experts")
        return MoeArgs(num_experts=int(n), topk=int(hf["num_experts_per_tok"]),
                       ffn_hidden_size=int(hf["moe_intermediate_size"]),
                       norm_topk_prob=bool(hf.get("norm_topk_prob", False)))

    def mcore_names(self, a: ModelArgs) -> list[str]:
        dense = super().mcore_names(a)
        out: list[str] = []
        for name in dense:
            if name.endswith("mlp.linear_fc1.weight"):
                p = name[: -len("linear_fc1.weight")]
                out.append(p + "router.weight")
                for e in range(a.moe.num_experts):
                    out += [f"{p}experts.local_experts.{e}.linear_fc1.weight",
                            f"{p}experts.local_experts.{e}.linear_fc2.weight"]
            elif not name.endswith("mlp.linear_fc2.weight"):
                out.append(name)
        return out

    def hf_sources(self, a: ModelArgs, name: str) -> list[str]:
        m = _EXPERT.match(name)
        if m:
            hp = f"model.layers.{m.group(1)}.mlp.experts.{m.group(2)}."
            if m.group(3) == "linear_fc1":
                return [hp + "gate_proj.weight", hp + "up_proj.weight"]
            return [hp + "down_proj.weight"]
        m = _ROUTER.match(name)
        if m:
            return [f"model.layers.{m.group(1)}.mlp.gate.weight"]
        return super().hf_sources(a, name)

    def to_mcore(self, a: ModelArgs, name: str, get_hf: Callable[[str], Tensor]) -> Tensor:
        if _EXPERT.match(name) and name.endswith("linear_fc1.weight"):
            return torch.cat([get_hf(s) for s in self.hf_sources(a, name)], dim=0)
        return super().to_mcore(a, name, get_hf)

    def to_hf(self, a: ModelArgs, name: str, full: Tensor) -> Iterator[tuple[str, Tensor]]:
        if _EXPERT.match(name) and name.endswith("linear_fc1.weight"):
            gate_name, up_name = self.hf_sources(a, name)
            gate, up = torch.chunk(full, 2, dim=0)
            yield gate_name, gate.contiguous()
            yield up_name, up.contiguous()
            return
        yield from super().to_hf(a, name, full)
