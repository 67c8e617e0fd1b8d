"""Weight sync through the filesystem: HF-named tensors -> a safetensors folder an engine can load.

Why atomic: an engine (or a person) that sees the folder must never see half of it. Shards are written into a
`<name>.tmp` folder next to the target and published by `mcore_rl.fsio` (fsync tree, rename, fsync parent).
Why buckets: tensors stream in from the trainer's gather; holding a whole 70B state dict in RAM is not an option.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mcore_rl import fsio

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Small files an HF loader (and SGLang's update_weights_from_disk) may want next to the weights.
SIDECAR_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
_VERSION_DIR = re.compile(r"^v(\d+)$")


def _write_shard(bucket: dict[str, torch.Tensor], path: Path) -> None:
    save_file(bucket, str(path), metadata={"format": "pt"})  # fsio fsyncs the whole folder before its rename


def write_hf_folder(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | os.PathLike,
    *,
    config_dir: str | os.PathLike | None = None,
    bucket_mb: float = 512.0,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write tensors as HF safetensors shards (+ index when sharded) into `out_dir`, atomically.

    `config_dir`: an HF folder whose config/tokenizer files are copied alongside (config.json is required there).
    Returns the final folder. Raises on duplicate names or an empty iterable; the temp dir is removed on error.
    """
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass overwrite=True or use a fresh versioned folder")
    if config_dir is not None and not (Path(config_dir) / "config.json").is_file():
        raise FileNotFoundError(f"config_dir {config_dir} has no config.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    with fsio.atomic_dir(out, overwrite=overwrite) as tmp:
        limit = int(bucket_mb * 2**20)
        shards: list[tuple[Path, list[str]]] = []
        bucket: dict[str, torch.Tensor] = {}
        seen: set[str] = set()
        size = total = 0
        for name, tensor in named_tensors:
            if name in seen:
                raise ValueError(f"tensor {name!r} was given twice")
            seen.add(name)
            t = tensor.detach()
            t = t.to(device="cpu", dtype=dtype or t.dtype).contiguous()
            if any(t.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in bucket.values()):
                t = t.clone()  # safetensors refuses shared storage (e.g. tied embeddings)
            if bucket and size + t.nbytes > limit:
                shards.append((tmp / f"shard-{len(shards):05d}.safetensors", list(bucket)))
                _write_shard(bucket, shards[-1][0])
                bucket, size = {}, 0
            bucket[name] = t
            size += t.nbytes
            total += t.nbytes
        if not seen:
            raise ValueError(f"no tensors to write to {out}")
        shards.append((tmp / f"shard-{len(shards):05d}.safetensors", list(bucket)))
        _write_shard(bucket, shards[-1][0])
        _finalize_names(tmp, shards, total)
        if config_dir is not None:
            for fname in SIDECAR_FILES:
                src = Path(config_dir) / fname
                if src.is_file():
                    shutil.copy2(src, tmp / fname)
    return out


def _finalize_names(tmp: Path, shards: list[tuple[Path, list[str]]], total: int) -> None:
    if len(shards) == 1:
        shards[0][0].rename(tmp / SINGLE_NAME)
        return
    weight_map = {}
    for i, (path, names) in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        path.rename(tmp / final)
        weight_map.update({n: final for n in names})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2))


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The weight files of an HF folder (via its index when sharded)."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"weights folder {folder} does not exist")
    index = folder / INDEX_NAME
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists missing shards: {missing[:3]}")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    return files


def iter_safetensors(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) from an HF safetensors folder, one tensor in memory at a time."""
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def is_complete(path: str | os.PathLike) -> bool:
    try:
        safetensors_files(path)
    except (FileNotFoundError, KeyError, json.JSONDecodeError):
        return False
    return True


def versioned_dir(root: str | os.PathLike, version: int) -> Path:
    return Path(root) / f"v{int(version):08d}"


def prune_versions(root: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the newest `keep` version folders under root; returns what was removed."""
    root = Path(root)
    if not root.is_dir():
        return []
    versions = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _VERSION_DIR.match(p.name)))
    doomed = [p for _, p in versions[: max(0, len(versions) - keep)]]
    for p in doomed:
        fsio.remove_tree(p)  # renamed aside first: a crash never leaves a half-deleted v<N> that looks complete
    return doomed


def remove_stale_temp(root: str | os.PathLike) -> list[Path]:
    """Delete `v<N>.tmp` / `v<N>.old` folders a killed writer left under root (each a partial model copy)."""
    return fsio.sweep_stale(root, prefix="v")
