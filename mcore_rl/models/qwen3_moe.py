"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention + a routed Mixture-of-Experts MLP, in every layer or,
with `mlp_only_layers` / `decoder_sparse_step`, in some layers and a dense MLP (Llama names) in the others.

Megatron side (local spec, SequentialMLP experts): `mlp.router.weight` [E, H] and per expert
`mlp.experts.local_experts.<e>.linear_fc1.weight` = [gate_e; up_e] and `linear_fc2.weight` = down_e. Canonical names
carry the *global* expert index; under expert parallelism each rank holds a contiguous block of experts
(policy/hf_weights.py translates). HF checkpoint side: `mlp.gate.weight` and `mlp.experts.<e>.{gate,up,down}_proj`.

Router math: HF takes softmax over all experts, picks the top-k, and with `norm_topk_prob` renormalises them; that is
the same function as Megatron's softmax over the top-k logits (`moe_router_pre_softmax=False`). Without
`norm_topk_prob` HF keeps the raw top-k probabilities: Megatron's `moe_router_pre_softmax=True`. The operation
order differs (and Megatron scales by the routing weight before `linear_fc2`), which costs a few ulp per block and
<= 1.1e-6 in the tests' logits: docs/models.md, "Why the MoE logits are exact".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mcore_rl.models.base import ModelArgs, MoeArgs, register_family
from mcore_rl.models.fields import harmless, mapped
from mcore_rl.models.qwen import Qwen3Family

Tensor = torch.Tensor
_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_LAYER_MLP = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.(linear_fc1|linear_fc2)\.weight$")
_ROUTER = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.router\.weight$")


def _layer_list(value: Any, hf: dict[str, Any]) -> str | None:
    n = hf.get("num_hidden_layers", 0)
    bad = [i for i in (value or []) if not isinstance(i, int) or not 0 <= i < n]
    return f"layer indices {bad} are not layers of a {n}-layer model" if bad else None


def _sparse_step(value: Any, hf: dict[str, Any]) -> str | None:
    return None if isinstance(value, int) and value >= 1 else "must be a positive integer"


def dense_layers(hf: dict[str, Any]) -> tuple[int, ...]:
    """HF's rule: layer i routes iff i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    only, step = set(hf.get("mlp_only_layers") or []), int(hf.get("decoder_sparse_step", 1) or 1)
    return tuple(i for i in range(hf["num_hidden_layers"]) if i in only or (i + 1) % step)


@register_family("Qwen3MoeForCausalLM")
class Qwen3MoeFamily(Qwen3Family):
    extra_fields = {
        "num_experts": mapped(),
        "num_local_experts": mapped(),  # transformers >= 5 spells num_experts this way in config.json
        "num_experts_per_tok": mapped(),
        "moe_intermediate_size": mapped(),
        "norm_topk_prob": mapped(),
        "decoder_sparse_step": mapped(_sparse_step),  # dense layers among MoE layers (MoeArgs.dense_layers)
        "mlp_only_layers": mapped(_layer_list),
        "router_aux_loss_coef": harmless("a training-loss weight; ours is model.moe.aux_loss_coeff"),
        "output_router_logits": harmless("inference output switch"),
    }

    def moe_args(self, hf: dict[str, Any]) -> MoeArgs:
        n = hf.get("num_experts", hf.get("num_local_experts"))
        if not n:
            raise ValueError("Qwen3MoeForCausalLM config has no num_experts / num_local_experts")
        return MoeArgs(num_experts=int(n), topk=int(hf["num_experts_per_tok"]),
                       ffn_hidden_size=int(hf["moe_intermediate_size"]),
                       norm_topk_prob=bool(hf.get("norm_topk_prob", False)), dense_layers=dense_layers(hf))

    def mcore_names(self, a: ModelArgs) -> list[str]:
        dense = super().mcore_names(a)
        out: list[str] = []
        for name in dense:
            m = _LAYER_MLP.match(name)
            if m is None or not a.moe.is_moe_layer(int(m.group(1))):
                out.append(name)
            elif m.group(2) == "linear_fc1":
                p = name[: -len("linear_fc1.weight")]
                out.append(p + "router.weight")
                for e in range(a.moe.num_experts):
                    out += [f"{p}experts.local_experts.{e}.linear_fc1.weight",
                            f"{p}experts.local_experts.{e}.linear_fc2.weight"]
                out += self.shared_expert_names(a, p)
        return out

    def shared_expert_names(self, a: ModelArgs, prefix: str) -> list[str]:
        return []

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
