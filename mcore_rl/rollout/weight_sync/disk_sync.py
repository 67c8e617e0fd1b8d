"""Weight sync through the filesystem: HF-named tensors -> versioned safetensors folders `v<N>` an engine loads.

Each version is written by `write_hf_folder` (mcore_rl/models/hf_io.py): atomic, because an engine (or a person)
that sees the folder must never see half of it; in buckets, because tensors stream in from the trainer's gather and
holding a whole 70B state dict in RAM is not an option. Old versions are pruned, a killed writer's leftovers swept.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from mcore_rl import fsio
from mcore_rl.models.hf_io import INDEX_NAME, write_hf_folder

# the writer lives with the HF reader (models/hf_io.py): weight sync, the run's hf/ export and the converter share it
__all__ = ["INDEX_NAME", "is_complete", "iter_safetensors", "prune_versions", "remove_stale_temp", "safetensors_files",
           "versioned_dir", "write_hf_folder"]

_VERSION_DIR = re.compile(r"^v(\d+)$")


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
