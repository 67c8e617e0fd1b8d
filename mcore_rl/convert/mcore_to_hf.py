"""Megatron torch_dist checkpoint (any TP/PP it was saved with) -> HF safetensors folder.

Streams one layer at a time straight from the checkpoint files (no model build, no process group): read the
layer's global tensors, split each through the family adapter into HF tensors, cast, and hand them to a
size-bounded shard writer. Memory: one layer plus one output shard.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from itertools import groupby
from pathlib import Path
from typing import Any

import torch

from mcore_rl.convert.common import (
    HF_SUBDIR,
    ConvertError,
    ckpt_hf_config,
    dtype_name,
    parse_dtype,
    read_ckpt_meta,
    staged_output,
)
from mcore_rl.convert.dist_reader import DistCheckpointReader
from mcore_rl.convert.shapes import VOCAB_TENSORS, mcore_shape, split_layer
from mcore_rl.dtypes import long_name
from mcore_rl.models.base import ModelArgs, ModelFamily
from mcore_rl.models.hf_io import copy_side_files, write_hf_shards
from mcore_rl.models.llama import te_name
from mcore_rl.models.seq_cls import model_family

Box = tuple[str, tuple[int, ...], tuple[int, ...]]
_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")


def checkpoint_box(reader: DistCheckpointReader, args: ModelArgs, name: str) -> Box:
    """Where canonical tensor `name` lives in the checkpoint: (key, offsets, sizes), shapes checked."""
    layer, rest = split_layer(name)
    want = mcore_shape(args, name)
    expert = _EXPERT.match(rest) if layer is not None else None
    if layer is not None and layer in _per_layer_indices(reader):
        return _per_layer_box(reader, args, name, layer, rest, expert, want)
    if expert:  # SequentialMLP experts are stored stacked over [layer, expert]
        return _expert_box(reader, args, layer, int(expert.group(1)), expert.group(2), want)
    if layer is None:
        keys = [name]
    else:  # stacked over layers; local-spec layer norms are stored under Transformer Engine names
        keys = list(dict.fromkeys(["decoder.layers." + rest, "decoder.layers." + split_layer(te_name(name))[1]]))
    key = next((k for k in keys if k in reader), None)
    if key is None:
        raise ConvertError(f"tensor {name} (checkpoint key {keys[-1]}) missing from checkpoint {reader.path}")
    got = reader.shapes[key]
    if layer is not None:
        if got[1:] != want or got[0] != args.num_layers:
            raise ConvertError(
                f"tensor {key}: checkpoint has shape {got}, config implies {(args.num_layers, *want)} "
                f"(num_layers x {want}); is --hf-config the config of this checkpoint?"
            )
        return key, (layer, *([0] * len(want))), (1, *want)
    ok = got[1:] == want[1:] and got[0] >= want[0] if name in VOCAB_TENSORS else got == want
    if not ok:  # vocab tensors may carry TP padding rows beyond vocab_size
        raise ConvertError(
            f"tensor {key}: checkpoint has shape {got}, config implies {want}; "
            "is --hf-config the config of this checkpoint?"
        )
    return key, (0,) * len(want), want


def _per_layer_indices(reader: DistCheckpointReader) -> set[int]:
    """Layers stored under 'decoder.layers.<i>.' keys: Megatron stores layers one by one (not stacked over a
    leading layer axis) when they are not all alike, e.g. dense MLP layers among MoE layers."""
    out = getattr(reader, "_per_layer_indices", None)
    if out is None:
        out = {int(m.group(1)) for k in reader.shapes if (m := re.match(r"^decoder\.layers\.(\d+)\.", k))}
        reader._per_layer_indices = out
    return out


def _per_layer_box(reader: DistCheckpointReader, args: ModelArgs, name: str, layer: int, rest: str,
                   expert: re.Match | None, want: tuple[int, ...]) -> Box:
    p = f"decoder.layers.{layer}."
    if expert:  # this layer's experts stacked over [expert]
        key, e = f"{p}mlp.experts.experts.{expert.group(2)}", int(expert.group(1))
        full = (args.moe.num_experts, *want)
        if reader.shapes.get(key) != full:
            raise ConvertError(f"tensor {key}: checkpoint has shape {reader.shapes.get(key)}, config implies {full}")
        return key, (e, *([0] * len(want))), (1, *want)
    keys = list(dict.fromkeys([p + rest, p + split_layer(te_name(name))[1]]))
    key = next((k for k in keys if k in reader), None)
    if key is None or reader.shapes[key] != want:
        raise ConvertError(f"tensor {name} (checkpoint key {keys[-1]}, shape "
                           f"{reader.shapes.get(key) if key else None}) does not match the config's {want} in "
                           f"checkpoint {reader.path}")
    return key, (0,) * len(want), want


def _expert_box(reader: DistCheckpointReader, args: ModelArgs, layer: int, e: int, suffix: str,
                want: tuple[int, ...]) -> Box:
    key = f"decoder.layers.mlp.experts.experts.{suffix}"
    if key not in reader:
        raise ConvertError(f"tensor {key} missing from checkpoint {reader.path} (expected for a MoE model)")
    full = (args.num_layers, args.moe.num_experts, *want)
    if reader.shapes[key] != full:
        raise ConvertError(f"tensor {key}: checkpoint has shape {reader.shapes[key]}, config implies {full} "
                           "(num_layers x num_experts x ...); is --hf-config the config of this checkpoint?")
    return key, (layer, e, *([0] * len(want))), (1, 1, *want)


def _expert_axis(key: str) -> int:
    """Experts stacked over [layer, expert] (all layers alike) or over [expert] (per-layer keys)."""
    return 0 if re.match(r"^decoder\.layers\.\d+\.", key) else 1


def _read_group(reader: DistCheckpointReader, boxes: dict[str, Box]) -> dict[str, torch.Tensor]:
    """Read boxes in one pass; the experts of one layer share a checkpoint key, so they are read as one box
    spanning the expert axis and sliced afterwards."""
    by_key: dict[str, list[str]] = {}
    for n, (key, _, _) in boxes.items():
        by_key.setdefault(key, []).append(n)
    request: dict[str, Box] = {}
    for key, names in by_key.items():
        if len(names) == 1:
            request[names[0]] = boxes[names[0]]
            continue
        first = boxes[names[0]]
        ax = _expert_axis(key)
        last_e = max(boxes[n][1][ax] for n in names)
        sizes = list(first[2])
        sizes[ax] = last_e - first[1][ax] + 1
        request[key] = (key, first[1], tuple(sizes))
    loaded = reader.read(request)
    out = {}
    for n, (key, offsets, _) in boxes.items():
        if n in loaded:
            out[n] = loaded[n]
        else:
            ax = _expert_axis(key)
            start = request[key][1][ax]
            out[n] = loaded[key].narrow(ax, offsets[ax] - start, 1)
    return out


def iter_hf_tensors(reader: DistCheckpointReader, family: ModelFamily, args: ModelArgs,
                    dtype: torch.dtype, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors, one layer's worth read at a time."""
    from tqdm import tqdm

    names = family.mcore_names(args)
    boxes = {n: checkpoint_box(reader, args, n) for n in names}  # validate everything before reading
    with tqdm(total=len(names), unit="tensor", desc="mcore-to-hf", disable=not progress, file=sys.stderr) as bar:
        for _, group in groupby(names, key=lambda n: split_layer(n)[0] if split_layer(n)[0] is not None else n):
            group = list(group)
            loaded = _read_group(reader, {n: boxes[n] for n in group})
            for n in group:
                full = loaded.pop(n)
                if split_layer(n)[0] is not None:
                    full = full.reshape(mcore_shape(args, n))  # drop the [layer(, expert)] box axes
                for hf_name, t in family.to_hf(args, n, full):
                    yield hf_name, t.to(dtype).contiguous()
                bar.update()


def unused_model_keys(reader: DistCheckpointReader, args: ModelArgs, family: ModelFamily) -> list[str]:
    used = {checkpoint_box(reader, args, n)[0] for n in family.mcore_names(args)}
    return sorted(k for k in reader.shapes if k.startswith(_MODEL_PREFIXES) and k not in used)


def hf_config_for_output(cfg: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    out = dict(cfg)
    keys = [k for k in ("dtype", "torch_dtype") if k in out] or ["torch_dtype"]
    for k in keys:
        out[k] = long_name(dtype)
    return out


def _readable_by_all(folder: Path) -> None:
    """safetensors creates files 0600; a model folder is meant to be shared like any other output."""
    umask = os.umask(0)
    os.umask(umask)
    for f in folder.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~umask)


def mcore_to_hf(ckpt: str | Path, out: str | Path, hf_config: str | Path | None = None, dtype: str | None = None,
                max_shard_bytes: int = 2 << 30, force: bool = False, progress: bool = True) -> Path:
    """Export; `dtype=None` restores the dtype of the HF model the checkpoint came from (bit-exact round trip)."""
    ckpt = Path(ckpt).absolute()
    meta = read_ckpt_meta(ckpt)
    cfg = ckpt_hf_config(ckpt, hf_config)
    try:
        family = model_family(cfg)  # a reward model's score head too
        reader = DistCheckpointReader(ckpt)
    except (ValueError, FileNotFoundError) as e:
        raise ConvertError(str(e)) from e
    args = family.args(cfg)
    emb_key = checkpoint_box(reader, args, "embedding.word_embeddings.weight")[0]
    if dtype:
        out_dtype = parse_dtype(dtype)
    elif meta.get("hf_dtype"):
        out_dtype = parse_dtype(meta["hf_dtype"])
    else:  # a training checkpoint: keep what it stores
        out_dtype = reader.dtypes[emb_key]
    dtype_name(out_dtype)  # supported?
    unused = unused_model_keys(reader, args, family)
    if unused:
        print(f"warning: checkpoint tensors not exported: {', '.join(unused[:8])}", file=sys.stderr)
    side_src = Path(hf_config) if hf_config is not None else ckpt / HF_SUBDIR
    if side_src.is_file():
        side_src = side_src.parent
    with staged_output(out, force) as stage:
        stage.mkdir()
        write_hf_shards(iter_hf_tensors(reader, family, args, out_dtype, progress), stage, max_shard_bytes)
        if side_src.is_dir():
            copy_side_files(side_src, stage)
        (stage / "config.json").write_text(json.dumps(hf_config_for_output(cfg, out_dtype), indent=2) + "\n")
        _readable_by_all(stage)
    return Path(out).absolute()
