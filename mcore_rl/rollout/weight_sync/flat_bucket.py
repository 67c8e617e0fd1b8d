"""SGLang 0.5.23's `load_format="flattened_bucket"` on the sender side.

One bucket = one flat uint8 tensor holding its tensors back to back (no padding) + one metadata record per
tensor. /update_weights_from_distributed then needs one broadcast per bucket (the receiver allocates the buffer
from names/dtypes/shapes, `FlattenedTensorBucket.empty`), and /update_weights_from_tensor one IPC handle per
bucket and engine TP rank: a ForkingPickler dump of `{"flattened_tensor": flat, "metadata": [...]}`, whose
records SGLang reads by attribute (`name, shape, dtype, start_idx, end_idx, numel`, byte offsets).
The record class is SGLang's own when sglang is importable here (the server unpickles it by its module path),
else the mirror below, which `mcore-rl-serve` also accepts.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

LOAD_FORMAT = "flattened_bucket"


@dataclass
class FlattenedTensorMetadata:
    """Field for field SGLang's `srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def metadata_class() -> type:
    try:
        return importlib.import_module("sglang.srt.weight_sync.tensor_bucket").FlattenedTensorMetadata
    except (ImportError, AttributeError):
        return FlattenedTensorMetadata


def metadata(named: list[tuple[str, torch.Size | tuple[int, ...], torch.dtype]]) -> list[Any]:
    """Records for tensors packed back to back in this order (what SGLang's receiver recomputes)."""
    cls = metadata_class()
    out, offset = [], 0
    for name, shape, dtype in named:
        size = torch.Size(shape).numel() * dtype.itemsize
        if offset % dtype.itemsize:
            raise ValueError(f"unaligned tensor {name} at byte {offset} ({dtype}): a bucket holds one dtype")
        out.append(cls(name=name, shape=torch.Size(shape), dtype=dtype, start_idx=offset, end_idx=offset + size,
                       numel=size))  # fmt: skip
        offset += size
    return out


def tensor_bucket(
    flat: torch.Tensor, named: list[tuple[str, torch.Size | tuple[int, ...], torch.dtype]]
) -> dict:
    """The object one engine TP rank unpickles for /update_weights_from_tensor with load_format=flattened_bucket."""
    meta = metadata(named)
    if meta and meta[-1].end_idx != flat.numel():
        raise ValueError(f"flat bucket holds {flat.numel()} bytes, its tensors {meta[-1].end_idx}")
    return {"flattened_tensor": flat, "metadata": meta}


def flat_groups(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a tensor stream into flat-packable buckets of about `bucket_bytes` (a larger tensor is a bucket of
    its own; a tensor whose byte offset would not be a multiple of its itemsize starts a new bucket)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        nb = t.numel() * t.element_size()
        if bucket and (size + nb > bucket_bytes or size % t.element_size()):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nb
    if bucket:
        yield bucket


def flatten(named: list[tuple[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """One uint8 tensor on `device` holding `named` back to back (the copy an engine rank reads)."""
    total = sum(t.numel() * t.element_size() for _, t in named)
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    pos = 0
    for _, t in named:
        nb = t.numel() * t.element_size()
        flat[pos : pos + nb].view(t.dtype).view(t.shape).copy_(t)
        pos += nb
    return flat
