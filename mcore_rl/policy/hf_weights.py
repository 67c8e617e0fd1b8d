"""HF weights <-> this rank's Megatron shards, through the model family's adapter.

Loading: every rank builds only the tensors of its own PP stage and slices its TP part (one full tensor at a time).
Gathering (weight_stream.py): one parameter at a time is TP-gathered into a flat bucket and turned into HF-named
tensors by the adapter; later PP stages send their buckets to global rank 0 one by one. Used by policy init,
weight sync and export.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from mcore_rl import distributed as D
from mcore_rl.models.base import ModelArgs, ModelFamily
from mcore_rl.policy.build import unwrap
from mcore_rl.policy.lora import is_adapter_param
from mcore_rl.policy.param_names import copy_shard, global_name, is_fc1, tp
from mcore_rl.policy.weight_stream import (
    Bucket,
    MemoryMeter,
    entries_from_meta,
    stage_buckets,
    stage_src_rank,
)

DEFAULT_BUCKET_BYTES = 512 * 2**20

def _tp_slice(name: str, full: torch.Tensor, param: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    if is_fc1(name):  # each TP rank holds [gate_r; up_r]
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, size, 0)[rank], torch.chunk(up, size, 0)[rank]], dim=0)
    return torch.chunk(full, size, dim=dim)[rank]


def _pad_vocab(name: str, full: torch.Tensor, padded_rows: int) -> torch.Tensor:
    if name in ("embedding.word_embeddings.weight", "output_layer.weight") and full.shape[0] < padded_rows:
        pad = full.new_zeros(padded_rows - full.shape[0], *full.shape[1:])
        return torch.cat([full, pad], dim=0)
    return full


@torch.no_grad()
def load_full_tensors(
    model, family: ModelFamily, args: ModelArgs, get_full: Callable[[str], torch.Tensor]
) -> int:
    """Fill this rank's parameters from full canonical tensors returned by `get_full(canonical_name)`.

    Raises with the tensor name and both shapes on any mismatch. Returns the number of tensors loaded.
    """
    gpt = unwrap(model)
    n = 0
    for local_name, param in gpt.named_parameters():
        if is_adapter_param(local_name):
            continue  # LoRA adapters are not HF weights (policy/lora_state.py loads them)
        name = global_name(gpt, local_name)
        tp_rank, tp_size = tp(name)
        source = (
            "embedding.word_embeddings.weight"
            if (name == "output_layer.weight" and args.tie_word_embeddings)
            else name
        )
        full = get_full(source).to(torch.float32)
        full = _pad_vocab(
            name, full, param.shape[0] * (tp_size if getattr(param, "tensor_model_parallel", False) else 1)
        )
        shard = _tp_slice(name, full, param, tp_rank, tp_size)
        copy_shard(param, shard, f"shape mismatch for {name} (tp={tp_size})",
                   "is the HF config the one these weights belong to?")
        n += 1
    return n


def load_hf_into_model(model, family: ModelFamily, args: ModelArgs, reader) -> int:
    """Initialise the (sharded) policy directly from an HF folder via the adapter."""

    def get_full(name: str) -> torch.Tensor:
        return family.to_mcore(args, name, reader.get)

    return load_full_tensors(model, family, args, get_full)


def iter_buckets(
    model, family: ModelFamily, args: ModelArgs, dst: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    meter: MemoryMeter | None = None,
) -> Iterator[Bucket]:  # fmt: skip
    """HF buckets of the whole model on global rank `dst` (= 0); every rank must drive the iterator.

    Stage by stage: each stage is gathered parameter by parameter into buckets on its (DP=0, TP=0) rank; a later
    stage's source sends its buckets to rank 0 one at a time over the gloo world group (host memory), so no rank
    ever holds a whole stage.
    """
    from megatron.core import parallel_state as ps

    if dst != 0:
        raise ValueError(f"weights are streamed to global rank 0, not {dst}")
    rank = D.global_rank()
    pp_size = ps.get_pipeline_model_parallel_world_size()
    my_stage = ps.get_pipeline_model_parallel_rank()
    for stage in range(pp_size):
        src = stage_src_rank(stage)
        if stage == my_stage:
            for bucket in stage_buckets(model, family, args, bucket_bytes, meter, keep=rank == src):
                if rank == dst:
                    yield bucket
                else:
                    D.send_object((bucket.meta(), bucket.data[: bucket.used].cpu()), dst)
            if rank == src and src != dst:
                D.send_object(None, dst)
        elif rank == dst:
            while (msg := D.recv_object(src)) is not None:
                meta, data = msg
                yield Bucket(data, entries_from_meta(meta), last=meta["last"])


def iter_hf_tensors(
    model, family: ModelFamily, args: ModelArgs, dst: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    meter: MemoryMeter | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """Full HF-named tensors on rank `dst` (the weight-sync / export stream); views into the current bucket."""
    for bucket in iter_buckets(model, family, args, dst, bucket_bytes, meter):
        yield from bucket.named_tensors()
