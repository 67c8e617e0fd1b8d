"""HF weights <-> this rank's Megatron shards, through the model family's adapter.

Loading: every rank builds only the tensors of its own PP stage and slices its TP part (one full tensor at a time).
Gathering: TP shards are all-gathered inside the TP group, PP stages send their tensors to global rank 0, and the
adapter turns each full canonical tensor into HF-named tensors. Used by policy init, weight sync and export.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from mcore_rl.models.base import ModelArgs, ModelFamily
from mcore_rl.models.llama import canonical_name
from mcore_rl.policy.build import unwrap

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")


def _ep() -> tuple[int, int]:
    """(expert-parallel rank, size); (0, 1) for dense models and EP=1."""
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()


def _num_local_experts(gpt) -> int:
    return gpt.config.num_moe_experts // _ep()[1] if gpt.config.num_moe_experts else 0


def _expert_name(name: str, ep_rank: int, num_local: int) -> str:
    """'...local_experts.<j>...' (index on this EP rank) -> '...local_experts.<global e>...'."""
    m = _LOCAL_EXPERT.match(name)
    if not m:
        return name
    return f"{m.group(1)}{ep_rank * num_local + int(m.group(2))}{m.group(3)}"


def _global_name(gpt, local_name: str) -> str:
    """Local parameter name (stage-local layer index, EP-local expert index, either spec) -> canonical name with
    the global layer and expert indices."""
    m = _LAYER.match(local_name)
    if m:
        layer = gpt.decoder.layers[int(m.group(1))]
        local_name = f"decoder.layers.{layer.layer_number - 1}.{m.group(2)}"
    if _LOCAL_EXPERT.match(local_name):
        local_name = _expert_name(local_name, _ep()[0], _num_local_experts(gpt))
    return canonical_name(local_name)


def _is_expert(name: str) -> bool:
    return _LOCAL_EXPERT.match(name) is not None


def _is_fc1(name: str) -> bool:
    """Dense or expert fc1: [gate; up], sliced per TP rank on each half."""
    return name.endswith("mlp.linear_fc1.weight") or (_is_expert(name) and name.endswith("linear_fc1.weight"))


def _tp_slice(name: str, full: torch.Tensor, param: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    if _is_fc1(name):  # each TP rank holds [gate_r; up_r]
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, size, 0)[rank], torch.chunk(up, size, 0)[rank]], dim=0)
    return torch.chunk(full, size, dim=dim)[rank]


def _pad_vocab(name: str, full: torch.Tensor, padded_rows: int) -> torch.Tensor:
    if name in ("embedding.word_embeddings.weight", "output_layer.weight") and full.shape[0] < padded_rows:
        pad = full.new_zeros(padded_rows - full.shape[0], *full.shape[1:])
        return torch.cat([full, pad], dim=0)
    return full


def _tp(name: str = ""):
    """(rank, size) of the tensor-parallel group that shards `name` (the expert-TP group for expert weights)."""
    from megatron.core import parallel_state as ps

    if _is_expert(name):
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


@torch.no_grad()
def load_full_tensors(model, family: ModelFamily, args: ModelArgs, get_full: Callable[[str], torch.Tensor]) -> int:
    """Fill this rank's parameters from full canonical tensors returned by `get_full(canonical_name)`.

    Raises with the tensor name and both shapes on any mismatch. Returns the number of tensors loaded.
    """
    gpt = unwrap(model)
    n = 0
    for local_name, param in gpt.named_parameters():
        name = _global_name(gpt, local_name)
        tp_rank, tp_size = _tp(name)
        source = "embedding.word_embeddings.weight" if (
            name == "output_layer.weight" and args.tie_word_embeddings) else name
        full = get_full(source).to(torch.float32)
        full = _pad_vocab(name, full, param.shape[0] * (tp_size if getattr(param, "tensor_model_parallel", False)
                                                         else 1))
        shard = _tp_slice(name, full, param, tp_rank, tp_size)
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(
                f"shape mismatch for {name}: checkpoint gives {tuple(shard.shape)} for this rank, model expects "
                f"{tuple(param.shape)} (tp={tp_size}); is the HF config the one these weights belong to?"
            )
        param.data.copy_(shard.to(param.dtype))
        n += 1
    return n


def load_hf_into_model(model, family: ModelFamily, args: ModelArgs, reader) -> int:
    """Initialise the (sharded) policy directly from an HF folder via the adapter."""

    def get_full(name: str) -> torch.Tensor:
        return family.to_mcore(args, name, reader.get)

    return load_full_tensors(model, family, args, get_full)


def _gather_tp(name: str, local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    tp_rank, tp_size = _tp(name)
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return local
    group = ps.get_expert_tensor_parallel_group() if _is_expert(name) else ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(tp_size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    if _is_fc1(name):
        gates, ups = zip(*(torch.chunk(p, 2, dim=0) for p in parts))
        return torch.cat([*gates, *ups], dim=0)
    return torch.cat(parts, dim=param.partition_dim)


@torch.no_grad()
def iter_full_tensors(model, args: ModelArgs, dst: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (canonical name, full tensor) on global rank `dst` only; every rank must drive the iterator.

    Order: pipeline stage by stage. The stage's (tp=0, dp=0) rank sends each gathered tensor to `dst`.
    """
    from megatron.core import parallel_state as ps

    gpt = unwrap(model)
    rank = dist.get_rank()
    pp_size = ps.get_pipeline_model_parallel_world_size()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    for stage in range(pp_size):
        if stage == pp_rank:
            items = []
            for local_name, param in gpt.named_parameters():
                name = _global_name(gpt, local_name)
                if name == "output_layer.weight" and args.tie_word_embeddings:
                    continue  # the tied copy on the last stage; the embedding is the source of truth
                full = _gather_tp(name, param.data, param)
                if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                    full = full[: args.vocab_size]
                if _is_expert(name):
                    items += _gather_ep(gpt, local_name, full)
                else:
                    items.append((name, full))
        else:
            items = None
        if pp_size == 1:
            if rank == dst:
                yield from items  # type: ignore[misc]
            continue
        # pipeline: the stage's source rank ships names + tensors to dst (object list keeps shapes/dtypes)
        src_rank = _stage_src_rank(stage)
        if src_rank == dst:
            if rank == dst:
                yield from items  # type: ignore[misc]
            continue
        if rank == src_rank:
            obj = [[(n, t.cpu()) for n, t in items]]  # type: ignore[union-attr]
            dist.send_object_list(obj, dst=dst)
        elif rank == dst:
            obj = [None]
            dist.recv_object_list(obj, src=src_rank)
            yield from obj[0]  # type: ignore[misc]


def _gather_ep(gpt, local_name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One expert weight (TP-gathered) from every EP rank: each holds a different block of experts."""
    from megatron.core import parallel_state as ps

    m = _LAYER.match(local_name)
    name = local_name
    if m:
        name = f"decoder.layers.{gpt.decoder.layers[int(m.group(1))].layer_number - 1}.{m.group(2)}"
    _, ep_size = _ep()
    parts = [full]
    if ep_size > 1:
        parts = [torch.empty_like(full) for _ in range(ep_size)]
        dist.all_gather(parts, full.contiguous(), group=ps.get_expert_model_parallel_group())
    num_local = _num_local_experts(gpt)
    return [(canonical_name(_expert_name(name, r, num_local)), t) for r, t in enumerate(parts)]


def _stage_src_rank(stage: int) -> int:
    """Global rank of (pp=stage, tp=0, dp=0) under Megatron's default tp-dp-pp rank order (pp slowest)."""
    from megatron.core import parallel_state as ps

    return stage * (dist.get_world_size() // ps.get_pipeline_model_parallel_world_size())


def iter_hf_tensors(model, family: ModelFamily, args: ModelArgs, dst: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF-named tensors on rank `dst` (the weight-sync / export stream)."""
    for name, full in iter_full_tensors(model, args, dst):
        yield from family.to_hf(args, name, full)
