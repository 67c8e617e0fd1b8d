"""Names and shard layout of this rank's Megatron parameters: global layer/expert indices, which tensor-parallel
group shards a parameter, and the fused [gate; up] fc1 layout.

Why a module of its own: loading HF weights into the shards (hf_weights.py) and gathering the shards back into
HF tensors (weight_stream.py) must agree on these facts; both read them here, neither from the other.
"""

from __future__ import annotations

import re

import torch

from mcore_rl.models.llama import canonical_name

LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")


def ep() -> tuple[int, int]:
    """(expert-parallel rank, size); (0, 1) for dense models and EP=1."""
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()


def num_local_experts(gpt) -> int:
    return gpt.config.num_moe_experts // ep()[1] if gpt.config.num_moe_experts else 0


def expert_name(name: str, ep_rank: int, num_local: int) -> str:
    """'...local_experts.<j>...' (index on this EP rank) -> '...local_experts.<global e>...'."""
    m = LOCAL_EXPERT.match(name)
    if not m:
        return name
    return f"{m.group(1)}{ep_rank * num_local + int(m.group(2))}{m.group(3)}"


def global_name(gpt, local_name: str) -> str:
    """Local parameter name (stage-local layer index, EP-local expert index, either spec) -> canonical name with
    the global layer and expert indices."""
    m = LAYER.match(local_name)
    if m:
        layer = gpt.decoder.layers[int(m.group(1))]
        local_name = f"decoder.layers.{layer.layer_number - 1}.{m.group(2)}"
    if LOCAL_EXPERT.match(local_name):
        local_name = expert_name(local_name, ep()[0], num_local_experts(gpt))
    return canonical_name(local_name)


def is_expert(name: str) -> bool:
    return LOCAL_EXPERT.match(name) is not None


def is_fc1(name: str) -> bool:
    """Dense or expert fc1: [gate; up], sliced per TP rank on each half."""
    return name.endswith(("mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "shared_experts.linear_fc1.weight")) or (
        is_expert(name) and name.endswith("linear_fc1.weight"))


def tp(name: str = ""):
    """(rank, size) of the tensor-parallel group that shards `name` (the expert-TP group for expert weights)."""
    from megatron.core import parallel_state as ps

    if is_expert(name):
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def copy_shard(param: torch.Tensor, shard: torch.Tensor, what: str, hint: str) -> None:
    """Copy this rank's slice of a full tensor into its parameter, refusing a shape that does not fit in one line
    (`what` names the tensor, `hint` the likely cause) rather than letting a broadcast copy hide a wrong layout."""
    if tuple(shard.shape) != tuple(param.shape):
        raise ValueError(f"{what}: the file gives {tuple(shard.shape)} for this rank, the model expects "
                         f"{tuple(param.shape)}; {hint}")
    param.data.copy_(shard.to(param.dtype))
