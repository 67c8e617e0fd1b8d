"""Streaming access to HF safetensors folders: read one tensor at a time; write size-bounded shards plus the
source model's side files. The one HF-folder writer (weight sync, the run's hf/ export and the converter use it)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mcore_rl import fsio

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".onnx", ".npz")
INDEX_SUFFIX = ".index.json"  # model.safetensors.index.json, pytorch_model.bin.index.json


class HFReader:
    """Lazily opens the safetensors file(s) of an HF folder and returns tensors by name."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / INDEX_NAME
        single = self.folder / SINGLE_NAME
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
    tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path, max_shard_bytes: int = 2 << 30,
    dtype: torch.dtype | None = None,
) -> dict[str, str]:
    """Write tensors into model-0000x-of-0000y.safetensors shards + an index (or one model.safetensors) inside
    the existing folder `out_dir`; the caller makes the folder appear atomically (`write_hf_folder`, or the
    converter's staging). Holds at most one shard in memory. `dtype`: cast every tensor. Returns the weight map.
    Raises on a name given twice or on no tensors at all."""
    out = Path(out_dir)
    shard: dict[str, torch.Tensor] = {}
    files: list[list[str]] = []
    seen: set[str] = set()
    size = total = 0

    def flush() -> None:
        nonlocal shard, size
        save_file(shard, out / f"shard-{len(files):05d}.tmp", metadata={"format": "pt"})
        files.append(list(shard))
        shard, size = {}, 0

    for name, tensor in tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} was given twice")
        seen.add(name)
        t = tensor.detach().to(device="cpu", dtype=dtype or tensor.dtype).contiguous()
        if any(t.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in shard.values()):
            t = t.clone()  # safetensors refuses shared storage (e.g. tied embeddings)
        if shard and size + t.nbytes > max_shard_bytes:
            flush()
        shard[name] = t
        size += t.nbytes
        total += t.nbytes
    if not seen:
        raise ValueError(f"no tensors to write to {out}")
    flush()
    if len(files) == 1:
        os.replace(out / "shard-00000.tmp", out / SINGLE_NAME)
        return {n: SINGLE_NAME for n in files[0]}
    weight_map: dict[str, str] = {}
    for i, names in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        os.replace(out / f"shard-{i:05d}.tmp", out / fname)
        weight_map.update({n: fname for n in names})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2))
    return weight_map


def side_files(src: str | Path) -> list[Path]:
    """Every top-level file of an HF folder that is not a weight file or index: config.json,
    generation_config.json and whatever tokenizer files the model ships (tokenizer.json, added_tokens.json,
    vocab.json/merges.txt, tokenizer.model, chat_template.jinja, *.tiktoken, ...). Why not a fixed list: tokenizer
    kinds name their files differently, and a file left behind changes how the exported model tokenizes."""
    return sorted(p for p in Path(src).iterdir()
                  if p.is_file() and not p.name.startswith(".") and not p.name.endswith(INDEX_SUFFIX)
                  and p.suffix not in WEIGHT_SUFFIXES)


def copy_side_files(src: str | Path, dst: str | Path) -> None:
    """Config/tokenizer files that make a weights folder a loadable HF model (see `side_files`)."""
    for p in side_files(src):
        shutil.copy2(p, Path(dst) / p.name)


def write_hf_folder(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | os.PathLike,
    *,
    config_dir: str | os.PathLike | None = None,
    bucket_mb: float = 512.0,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """The HF-folder writer: tensors as safetensors shards of at most `bucket_mb` (+ index when sharded) and
    `config_dir`'s side files (config.json required there), published atomically (mcore_rl.fsio: written into
    `<name>.tmp`, fsynced, renamed), so a reader never sees half a folder. Returns the final folder."""
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass overwrite=True or use a fresh versioned folder")
    if config_dir is not None and not (Path(config_dir) / "config.json").is_file():
        raise FileNotFoundError(f"config_dir {config_dir} has no config.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    with fsio.atomic_dir(out, overwrite=overwrite) as tmp:
        write_hf_shards(named_tensors, tmp, int(bucket_mb * 2**20), dtype)
        if config_dir is not None:
            copy_side_files(config_dir, tmp)
    return out
