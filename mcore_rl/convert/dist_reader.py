"""Read slices of a Megatron torch_dist checkpoint in one process, without building a model or a process group.

Megatron stores every per-layer tensor as one global tensor with a leading layer axis (`decoder.layers.<suffix>`,
shape [num_layers, ...]) in PyTorch DCP format, whatever TP/PP wrote it. A small DCP load planner reads just the
requested box of such a tensor, so export can stream one layer at a time.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


class _BoxPlanner(DefaultLoadPlanner):
    """Each destination tensor is the box of its checkpoint tensor starting at `offsets[key]`."""

    def __init__(self, offsets: dict[str, tuple[int, ...]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.offsets = offsets

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, dst in self.state_dict.items():
            box = ChunkStorageMetadata(offsets=torch.Size(self.offsets[key]), sizes=dst.size())
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [box])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]


class _CachedMetadataReader(FileSystemReader):
    """The .metadata pickle is read once per checkpoint, not once per layer."""

    def __init__(self, path: str, metadata):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs):
        return self._metadata


class DistCheckpointReader:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / ".metadata").is_file():
            raise FileNotFoundError(f"{self.path}: no .metadata file; not a torch_dist checkpoint")
        md = FileSystemReader(str(self.path)).read_metadata()
        self.metadata = md
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        for key, m in md.state_dict_metadata.items():
            if isinstance(m, TensorStorageMetadata):
                self.shapes[key] = tuple(m.size)
                self.dtypes[key] = m.properties.dtype

    def __contains__(self, key: str) -> bool:
        return key in self.shapes

    def read(self, boxes: dict[str, tuple[str, tuple[int, ...], tuple[int, ...]]]) -> dict[str, torch.Tensor]:
        """{name: (key, offsets, sizes)} -> {name: tensor of `sizes`} in one pass over the files."""
        if not boxes:
            return {}
        dst = {key: torch.empty(sizes, dtype=self.dtypes[key]) for key, _, sizes in boxes.values()}
        offsets = {key: off for key, off, _ in boxes.values()}
        if len(dst) != len(boxes):
            raise ValueError("each checkpoint key may be requested once per read")
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp_load(dst, storage_reader=_CachedMetadataReader(str(self.path), self.metadata), planner=_BoxPlanner(offsets), no_dist=True)
        return {name: dst[key] for name, (key, _, _) in boxes.items()}
