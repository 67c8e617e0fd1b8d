"""Shared pieces of the converters: dtype names, one-line errors, and the all-or-nothing output directory.

Why a staged output: a conversion can die at any point (OOM, Ctrl-C, a node going away). The result is built in a
hidden sibling directory and renamed into place only when complete, so `--out` either does not exist or is a
finished checkpoint; a stale half-written sibling is swept by the next run.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from mcore_rl import fsio
from mcore_rl.dtypes import SHORT, short_name, torch_dtype

HF_SUBDIR = "hf"  # config + tokenizer files copied into a Megatron checkpoint (makes it self-describing)


class ConvertError(RuntimeError):
    """A user-facing problem (bad input, refused overwrite, a failed rank); the CLI prints it as one line.

    `detail` keeps the full traceback of a failed rank for `--traceback`.
    """

    def __init__(self, message: str, detail: str | None = None):
        super().__init__(message)
        self.detail = detail


def dtype_name(dtype: torch.dtype) -> str:
    """The CLI spelling (fp32 | bf16 | fp16) of a dtype the converter supports."""
    try:
        return short_name(dtype)
    except ValueError:
        raise ConvertError(f"unsupported dtype {dtype}; supported: {', '.join(SHORT)}") from None


def parse_dtype(name: str) -> torch.dtype:
    try:
        return torch_dtype(name)
    except ValueError:
        raise ConvertError(f"--dtype {name!r}: expected one of {', '.join(SHORT)}") from None


def parse_size(text: str) -> int:
    """'2GB', '500MB', '1GiB' or a plain byte count -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise ConvertError(f"--max-shard-size {text!r}: expected a size such as 2GB, 500MB or 1048576")
    unit = (m.group(2) or "").upper().rstrip("B")
    base = 1024 if unit.endswith("I") else 1000
    power = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit.rstrip("I")]
    size = int(float(m.group(1)) * base**power)
    if size <= 0:
        raise ConvertError(f"--max-shard-size {text!r} must be positive")
    return size


def check_output_free(out: Path, force: bool) -> None:
    """Refuse to touch an existing output unless --force, before any heavy work starts."""
    if out.exists() and not force:
        raise ConvertError(f"output {out} already exists; pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise ConvertError(f"output {out} exists and is not a directory; remove it first")


def staging_path(out: Path) -> Path:
    return out.parent / f".{out.name}.partial"


def scratch_path(stage: Path) -> Path:
    """Sibling for rendezvous files of the conversion ranks; swept with the staging dir."""
    return stage.with_name(stage.name + ".rdzv")


def _sweep(stage: Path) -> None:
    for p in (stage, stage.with_name(stage.name + ".tmp"), stage.with_name(stage.name + ".old"), scratch_path(stage)):
        if p.exists():
            shutil.rmtree(p)


@contextmanager
def staged_output(out: str | Path, force: bool) -> Iterator[Path]:
    """Yield a (not yet existing) staging path; on success rename it to `out`, on any error delete it.

    The caller creates the staging directory (checkpoint writers insist on creating theirs themselves).
    """
    out = Path(out).absolute()
    check_output_free(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = staging_path(out)
    _sweep(stage)  # a previous run that was killed
    try:
        yield stage
        if not stage.is_dir():
            raise ConvertError(f"internal error: conversion produced no output in {stage}")
        fsio.commit_staging(stage, out)  # fsync the tree, rename (keeping the old result until then), fsync parent
    except BaseException:
        _sweep(stage)
        raise


def read_ckpt_meta(ckpt: Path) -> dict[str, Any]:
    """The meta dict an mcore-rl checkpoint carries in its completion marker; refuses incomplete checkpoints."""
    from mcore_rl.checkpoint_io import COMPLETE

    marker = ckpt / COMPLETE
    if not ckpt.is_dir():
        raise ConvertError(f"--ckpt {ckpt}: no such directory")
    if not marker.is_file():
        raise ConvertError(f"--ckpt {ckpt} is not a complete mcore-rl checkpoint (no {COMPLETE}); refusing it")
    try:
        return json.loads(marker.read_text() or "{}")
    except json.JSONDecodeError as e:
        raise ConvertError(f"{marker}: not valid JSON ({e})") from e


def ckpt_hf_config(ckpt: Path, hf_config: str | Path | None) -> dict[str, Any]:
    """HF config for a checkpoint: --hf-config wins, then the copy under <ckpt>/hf, then the meta."""
    from mcore_rl.models.base import read_hf_config

    if hf_config is not None:
        try:
            return read_hf_config(hf_config)
        except FileNotFoundError as e:
            raise ConvertError(f"--hf-config: {e}") from e
    if (ckpt / HF_SUBDIR / "config.json").is_file():
        return read_hf_config(ckpt / HF_SUBDIR)
    meta = read_ckpt_meta(ckpt)
    if meta.get("hf_config"):
        return dict(meta["hf_config"])
    raise ConvertError(
        f"{ckpt} carries no HF config (no {HF_SUBDIR}/config.json, no hf_config in its meta); "
        "pass --hf-config DIR (the HF model folder it was trained from)"
    )
