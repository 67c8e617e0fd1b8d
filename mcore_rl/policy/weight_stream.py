"""The trainer's weight stream: this PP stage's parameters, TP-gathered one at a time, as HF-named tensors packed
into flat buckets of about `bucket_bytes`.

Why per parameter: gathering a whole stage first makes every TP rank hold the unsharded stage (70B at TP=8:
~140 GB per GPU for a moment). Here a rank holds at most one bucket plus one gathered parameter.
Why flat buckets: one buffer per bucket is what SGLang's `load_format="flattened_bucket"` reads (one broadcast per
bucket for NCCL, one IPC handle per bucket for colocated engines). The packing matches SGLang 0.5.23's
`FlattenedTensorBucket.empty`: entries back to back in order, no padding (so a bucket holds one dtype).
The gathered parameter is written straight into its bucket slot (`torch.cat(..., out=slot)`); the adapter's HF
tensors are views of that slot or, when the adapter copies (QKV split), are written back over it.
A LoRA-adapted linear streams its merged weight (W + alpha/r * B @ A, merged shard by shard before the gather),
so every receiver loads plain HF weights and the adapters themselves never enter a bucket.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from mcore_rl import distributed as D
from mcore_rl.models.base import ModelArgs, ModelFamily
from mcore_rl.models.llama import canonical_name
from mcore_rl.policy.param_names import (
    LAYER,
    ep,
    expert_name,
    global_name,
    is_expert,
    is_fc1,
    num_local_experts,
    tp,
)


@dataclass
class MemoryMeter:
    """Bytes the stream holds beyond the model (gathered parts, bucket buffers, adapter copies); the peak is
    reported as `sync_peak_extra_mb`. `largest_param` / `bucket_bytes` give the bound it must stay under."""

    live: int = 0
    peak: int = 0
    largest_param: int = 0
    bucket_bytes: int = 0
    merged_shard: int = 0  # LoRA: the largest merged weight shard (W + s * B @ A) held while it is gathered

    def add(self, n: int) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)

    def sub(self, n: int) -> None:
        self.live -= n

    @property
    def bound(self) -> int:
        """One bucket (a parameter larger than a bucket is a bucket of its own) plus one gathered parameter (plus,
        with LoRA, that parameter's merged shard)."""
        return max(self.bucket_bytes, self.largest_param) + self.largest_param + self.merged_shard


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes into the bucket's flat buffer

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


@dataclass
class Bucket:
    """HF tensors packed back to back in one uint8 buffer (on the collective device)."""

    data: torch.Tensor
    entries: list[Entry] = field(default_factory=list)
    last: bool = False  # the last bucket of its PP stage

    def view(self, e: Entry) -> torch.Tensor:
        return self.data[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(e.name, self.view(e)) for e in self.entries]

    def meta(self) -> dict:
        """Names/dtypes/shapes as /update_weights_from_distributed wants them (+ `last`), small enough to pickle."""
        return {
            "names": [e.name for e in self.entries],
            "dtypes": [str(e.dtype).removeprefix("torch.") for e in self.entries],
            "shapes": [list(e.shape) for e in self.entries],
            "nbytes": self.used,
            "last": self.last,
        }

    @property
    def used(self) -> int:
        return self.entries[-1].offset + self.entries[-1].nbytes if self.entries else 0


def entries_from_meta(meta: dict) -> list[Entry]:
    """The packing a receiver of `Bucket.meta()` rebuilds (SGLang's FlattenedTensorBucket.empty does the same)."""
    out, offset = [], 0
    for name, dtype, shape in zip(meta["names"], meta["dtypes"], meta["shapes"], strict=True):
        e = Entry(name, getattr(torch, dtype), tuple(shape), offset)
        out.append(e)
        offset += e.nbytes
    return out


# ---------------------------------------------------------------- the plan: which parameter goes in which bucket
@dataclass(frozen=True)
class _Item:
    local_name: str
    name: str  # canonical, global indices
    param: torch.Tensor
    gathered_bytes: int  # size of the TP(/EP)-gathered tensor
    linear: torch.nn.Module | None = None  # the LoRA-adapted linear owning this weight (streamed merged)

    def data(self) -> torch.Tensor:
        if self.linear is None:
            return self.param.data
        from mcore_rl.policy.lora import merged_shard

        return merged_shard(self.linear)


def _plan(gpt, args: ModelArgs, bucket_bytes: int) -> list[list[_Item]]:
    from mcore_rl.policy.lora import adapted_linears, is_adapter_param

    adapted = {f"{n}.weight": m for n, m in adapted_linears(gpt)}
    items = []
    for local_name, param in gpt.named_parameters():
        if is_adapter_param(local_name):
            continue  # merged into their linear's weight below
        name = global_name(gpt, local_name)
        if name == "output_layer.weight" and args.tie_word_embeddings:
            continue  # the tied copy on the last stage; the embedding is the source of truth
        n = param.numel() * param.element_size()
        if getattr(param, "tensor_model_parallel", False):
            n *= tp(name)[1]
        if is_expert(name):
            n *= ep()[1]
        items.append(_Item(local_name, name, param, n, adapted.get(local_name)))
    buckets: list[list[_Item]] = []
    size = 0
    for it in items:
        same_dtype = bool(buckets) and buckets[-1][0].param.dtype == it.param.dtype
        if not buckets or not same_dtype or (size + it.gathered_bytes > bucket_bytes):
            buckets.append([])
            size = 0
        buckets[-1].append(it)
        size += it.gathered_bytes
    return buckets


# ---------------------------------------------------------------- gathering one parameter into its slot
def _tp_parts(name: str, param: torch.Tensor, data: torch.Tensor) -> list[torch.Tensor] | None:
    """Every TP rank's shard `data` of `param` (None when it is not TP-sharded)."""
    from megatron.core import parallel_state as ps

    if tp(name)[1] == 1 or not getattr(param, "tensor_model_parallel", False):
        return None
    group = (
        ps.get_expert_tensor_parallel_group() if is_expert(name) else ps.get_tensor_model_parallel_group()
    )
    return D.all_gather(data, group=group)


def _assemble(name: str, param: torch.Tensor, data: torch.Tensor, parts: list[torch.Tensor] | None,
              out: torch.Tensor) -> None:
    """Write the full canonical tensor into `out` (no temporary: cat writes into the slot)."""
    if parts is None:
        out.copy_(data)
    elif is_fc1(name):  # each TP rank holds [gate_r; up_r]
        halves = [torch.chunk(p, 2, dim=0) for p in parts]
        torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0, out=out)
    else:
        torch.cat(parts, dim=param.partition_dim, out=out)


class _Filler:
    """Fills one bucket buffer: gathered parameter -> slot -> adapter -> HF entries packed from the slot start."""

    def __init__(self, family: ModelFamily, args: ModelArgs, meter: MemoryMeter) -> None:
        self.family, self.args, self.meter = family, args, meter

    def place(self, bucket: Bucket, cursor: int, name: str, full: torch.Tensor) -> int:
        """`full` lives in bucket.data at `cursor`; pack its HF tensors there; returns the new cursor."""
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            full = full[: self.args.vocab_size]  # drop the vocab padding: a view, still at the slot start
        pieces = list(self.family.to_hf(self.args, name, full))
        base = bucket.data.data_ptr()
        pos, tiled = cursor, True
        for _, t in pieces:  # views laid out in order from the slot start need no copy
            tiled = tiled and t.is_contiguous() and t.data_ptr() - base == pos
            pos += t.numel() * t.element_size()
        if not tiled:
            copies = [(n, t if t.data_ptr() - base < 0 or t.data_ptr() - base >= bucket.data.numel()
                       else t.clone()) for n, t in pieces]  # fmt: skip
            extra = sum(t.numel() * t.element_size() for _, t in copies)
            self.meter.add(extra)
            pos = cursor
            for _, t in copies:
                nb = t.numel() * t.element_size()
                bucket.data[pos : pos + nb].view(t.dtype).copy_(t.reshape(-1))
                pos += nb
            self.meter.sub(extra)
            pieces = copies
        for hf_name, t in pieces:
            bucket.entries.append(Entry(hf_name, t.dtype, tuple(t.shape), cursor))
            cursor += t.numel() * t.element_size()
        return cursor


def stage_buckets(
    model, family: ModelFamily, args: ModelArgs, bucket_bytes: int, meter: MemoryMeter | None = None,
    keep: bool = True,
) -> Iterator[Bucket]:  # fmt: skip
    """This rank's stage as HF buckets. Collective within the stage (TP/EP all-gathers): every rank of the stage
    must drive it. `keep=False` (ranks whose copy nobody reads): gather, drop, yield nothing.

    A bucket is released by the stream when the consumer asks for the next one (do not keep references)."""
    from mcore_rl.policy.build import unwrap

    gpt = unwrap(model)
    meter = meter if meter is not None else MemoryMeter()
    meter.bucket_bytes = bucket_bytes
    plan = _plan(gpt, args, bucket_bytes)
    meter.largest_param = max([meter.largest_param] + [it.gathered_bytes for b in plan for it in b])
    meter.merged_shard = max([meter.merged_shard] + [it.param.numel() * it.param.element_size()
                                                     for b in plan for it in b if it.linear is not None])  # fmt: skip
    filler = _Filler(family, args, meter)
    device = D.collective_device()
    with torch.no_grad():
        for i, items in enumerate(plan):
            cap = sum(it.gathered_bytes for it in items)
            bucket = Bucket(torch.empty(cap, dtype=torch.uint8, device=device), last=i == len(plan) - 1) if keep \
                else None  # fmt: skip
            meter.add(cap if keep else 0)
            cursor = 0
            for it in items:
                cursor = _gather_into(gpt, it, bucket, cursor, filler, meter)
            if bucket is not None:
                yield bucket
                del bucket
            meter.sub(cap if keep else 0)


def _gather_into(
    gpt, it: _Item, bucket: Bucket | None, cursor: int, filler: _Filler, meter: MemoryMeter
) -> int:
    from megatron.core import parallel_state as ps

    data = it.data()
    merged_bytes = data.numel() * data.element_size() if it.linear is not None else 0
    meter.add(merged_bytes)
    parts = _tp_parts(it.name, it.param, data)
    part_bytes = sum(p.numel() * p.element_size() for p in parts) if parts is not None else 0
    part_bytes += merged_bytes  # released with the parts
    meter.add(part_bytes - merged_bytes)
    if not is_expert(it.name):
        if bucket is not None:
            n = it.gathered_bytes
            slot = bucket.data[cursor : cursor + n].view(it.param.dtype)
            shape = list(it.param.shape)
            if parts is not None:
                shape[0 if is_fc1(it.name) else it.param.partition_dim] *= len(parts)
            full = slot.view(shape)
            _assemble(it.name, it.param, data, parts, full)
            del parts
            meter.sub(part_bytes)
            return filler.place(bucket, cursor, it.name, full)
        meter.sub(part_bytes)
        return cursor
    # expert weight: TP-gathered, then every EP rank's block of experts (each a canonical tensor of its own)
    shape = list(it.param.shape)
    if parts is not None:
        shape[0 if is_fc1(it.name) else it.param.partition_dim] *= len(parts)
    full_tp = torch.empty(shape, dtype=it.param.dtype, device=it.param.device)
    meter.add(full_tp.numel() * full_tp.element_size())
    _assemble(it.name, it.param, data, parts, full_tp)
    meter.sub(part_bytes)
    del parts
    ep_size = ep()[1]
    experts = D.all_gather(full_tp, group=ps.get_expert_model_parallel_group()) if ep_size > 1 else [full_tp]
    ep_bytes = sum(t.numel() * t.element_size() for t in experts) if ep_size > 1 else 0
    meter.add(ep_bytes)
    if bucket is None:
        meter.sub(full_tp.numel() * full_tp.element_size() + ep_bytes)
        return cursor
    m = LAYER.match(it.local_name)
    name = it.local_name
    if m:
        name = f"decoder.layers.{gpt.decoder.layers[int(m.group(1))].layer_number - 1}.{m.group(2)}"
    num_local = num_local_experts(gpt)
    for r, t in enumerate(experts):
        nb = t.numel() * t.element_size()
        full = bucket.data[cursor : cursor + nb].view(t.dtype).view(t.shape)
        full.copy_(t)
        cursor = filler.place(bucket, cursor, canonical_name(expert_name(name, r, num_local)), full)
    meter.sub(full_tp.numel() * full_tp.element_size() + ep_bytes)
    return cursor


def stage_src_rank(stage: int) -> int:
    """Global rank of (pp=stage, tp=0, dp=0) under Megatron's default tp-dp-pp rank order (pp slowest)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        return 0
    return stage * (dist.get_world_size() // ps.get_pipeline_model_parallel_world_size())
