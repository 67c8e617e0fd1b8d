"""Streaming access to HF safetensors checkpoints (read one tensor at a time; write in size-bounded shards)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

HF_SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
)


class HFReader:
    """Lazily opens the safetensors file(s) of an HF folder and returns tensors by name."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        single = self.folder / "model.safetensors"
        if index.is_file():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif single.is_file():
            with safe_open(single, "pt") as f:
                self.weight_map = {k: single.name for k in f.keys()}
        else:
            raise FileNotFoundError(
                f"{self.folder}: no model.safetensors or model.safetensors.index.json "
                "(only safetensors HF checkpoints are supported)"
            )
        self._handles: dict[str, object] = {}

    def close(self) -> None:
        """Drop the safetensors handles (their memory maps count towards RSS while open)."""
        self._handles.clear()

    def __enter__(self) -> HFReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def names(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} missing from HF checkpoint {self.folder}")
        fname = self.weight_map[name]
        if fname not in self._handles:
            self._handles[fname] = safe_open(self.folder / fname, "pt")
        return self._handles[fname].get_tensor(name)  # type: ignore[attr-defined]

    def shape(self, name: str) -> tuple[int, ...]:
        fname = self.weight_map[name]
        if fname not in self._handles:
            self._handles[fname] = safe_open(self.folder / fname, "pt")
        return tuple(self._handles[fname].get_slice(name).get_shape())  # type: ignore[attr-defined]


def write_hf_shards(
    tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path, max_shard_bytes: int = 2 << 30
) -> dict[str, str]:
    """Write tensors into model-0000x-of-0000y.safetensors shards + an index (or one model.safetensors).

    Holds at most one shard in memory. Returns the weight map.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    size = 0
    files: list[list[str]] = []
    total = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            save_file(shard, out / f"shard-{len(files):05d}.tmp", metadata={"format": "pt"})
            files.append(list(shard))
            shard, size = {}, 0

    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
        shard[name] = t.detach().contiguous().cpu()
        size += nbytes
        total += nbytes
    flush()
    weight_map: dict[str, str] = {}
    if len(files) == 1:
        os.replace(out / "shard-00000.tmp", out / "model.safetensors")
        weight_map = {n: "model.safetensors" for n in files[0]}
    else:
        for i, names in enumerate(files):
            fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            os.replace(out / f"shard-{i:05d}.tmp", out / fname)
            weight_map.update({n: fname for n in names})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return weight_map


def copy_side_files(src: str | Path, dst: str | Path) -> None:
    """Config/tokenizer files that make a weights folder a loadable HF model."""
    for name in HF_SIDE_FILES:
        p = Path(src) / name
        if p.is_file():
            shutil.copy2(p, Path(dst) / name)
