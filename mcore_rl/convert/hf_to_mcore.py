"""HF safetensors folder -> Megatron torch_dist checkpoint that any TP/PP layout can load (resharding on load).

Each of the tp*pp ranks builds only its own shard of the GPTModel, fills it one full HF tensor at a time through the
family adapter, and all ranks write one dist-checkpoint together. The HF config and tokenizer files travel inside
the checkpoint (`hf/`) and the completion marker records architecture, dtypes and vocab, so the reverse direction
needs nothing else.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mcore_rl.convert.common import (
    HF_SUBDIR,
    ConvertError,
    dtype_name,
    parse_dtype,
    scratch_path,
    staged_output,
)
from mcore_rl.convert.launch import run_ranks
from mcore_rl.convert.shapes import check_hf_checkpoint
from mcore_rl.models.base import ModelArgs, ModelFamily, read_hf_config
from mcore_rl.models.hf_io import HFReader, copy_side_files
from mcore_rl.models.seq_cls import model_family

_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


@dataclass
class HfToMcoreJob:
    hf_dir: str
    stage: str
    tp: int
    pp: int
    dtype: str  # fp32 | bf16 | fp16
    meta: dict[str, Any]
    progress: bool = True
    ep: int = 1


def load_hf_model_info(hf_dir: str | Path) -> tuple[dict[str, Any], ModelFamily, ModelArgs]:
    """Config -> (config, family, args) with one-line errors for a missing config or an unknown architecture.
    A sequence classifier (reward model) gets its causal family's decoder and its score head (models/seq_cls.py)."""
    try:
        cfg = read_hf_config(hf_dir)
    except FileNotFoundError as e:
        raise ConvertError(str(e)) from e
    try:
        family = model_family(cfg)
        args = family.args(cfg)  # refuses config fields the adapter does not map exactly
    except ValueError as e:
        raise ConvertError(f"{Path(hf_dir) / 'config.json'}: {e}") from e
    return cfg, family, args


def hf_tensor_dtype(reader: HFReader, name: str) -> torch.dtype:
    """Stored dtype of one tensor, read from the safetensors header (no data)."""
    from safetensors import safe_open

    with safe_open(reader.folder / reader.weight_map[name], "pt") as f:
        code = f.get_slice(name).get_dtype()
    if code not in _SAFETENSORS_DTYPES:
        raise ConvertError(f"tensor {name} is stored as {code}; supported: {', '.join(_SAFETENSORS_DTYPES)}")
    return _SAFETENSORS_DTYPES[code]


def _convert_rank(job: HfToMcoreJob) -> None:
    from tqdm import tqdm

    from mcore_rl.checkpoint_io import save_dist_checkpoint
    from mcore_rl.convert.megatron_model import build_model
    from mcore_rl.distributed import init_distributed
    from mcore_rl.policy.hf_weights import load_full_tensors

    layout = init_distributed(job.tp, job.pp, ep=job.ep)
    _, family, args = load_hf_model_info(job.hf_dir)
    model = build_model(args, job.tp, job.pp, job.dtype, job.ep)
    reader = HFReader(job.hf_dir)
    n_local = sum(1 for _ in model.parameters())
    bar = tqdm(total=n_local, unit="tensor", desc=f"hf-to-mcore (rank 0 of {layout.world_size})",
               disable=not job.progress or layout.rank != 0, file=sys.stderr)

    def get_full(name: str) -> torch.Tensor:
        full = family.to_mcore(args, name, reader.get)
        bar.update()
        return full

    load_full_tensors(model, family, args, get_full)
    bar.close()
    save_dist_checkpoint(job.stage, model, meta=job.meta)


def hf_to_mcore(hf_dir: str | Path, out: str | Path, tp: int = 1, pp: int = 1, dtype: str | None = None,
                force: bool = False, progress: bool = True, ep: int = 1) -> Path:
    """Convert; returns the checkpoint path. `dtype=None` keeps the HF weights' dtype."""
    from mcore_rl.models.moe_spec import validate_moe_parallel
    from mcore_rl.models.spec import validate_parallel

    hf_dir = Path(hf_dir).absolute()
    cfg, family, args = load_hf_model_info(hf_dir)
    try:
        validate_parallel(args, tp, pp)
        validate_moe_parallel(args, tp, ep)
        reader = HFReader(hf_dir)
    except (ValueError, FileNotFoundError) as e:
        raise ConvertError(str(e)) from e
    unused = check_hf_checkpoint(family, args, reader)
    if unused:
        print(f"warning: {len(unused)} HF tensor(s) not used by the conversion: {', '.join(unused[:8])}"
              f"{' ...' if len(unused) > 8 else ''}", file=sys.stderr)
    hf_dtype = hf_tensor_dtype(reader, "model.embed_tokens.weight")
    out_dtype = parse_dtype(dtype) if dtype else hf_dtype
    meta = {
        "format": "mcore-rl torch_dist",
        "created_by": "mcore-rl-convert hf-to-mcore",
        "source": str(hf_dir),
        "architecture": args.architecture,
        "vocab_size": args.vocab_size,
        "hf_dtype": dtype_name(hf_dtype),
        "dtype": dtype_name(out_dtype),
        "saved_tp": tp,
        "saved_pp": pp,
        "saved_ep": ep,
        "hf_config": cfg,
    }
    out = Path(out).absolute()
    with staged_output(out, force) as stage:
        job = HfToMcoreJob(str(hf_dir), str(stage), tp, pp, dtype_name(out_dtype), meta, progress, ep)
        run_ranks(_convert_rank, job, tp * pp * ep, scratch=scratch_path(stage))  # EP ranks = data-parallel
        if not (stage / "complete.json").is_file():
            raise ConvertError(f"internal error: ranks finished but {stage} holds no complete checkpoint")
        (stage / HF_SUBDIR).mkdir()
        copy_side_files(hf_dir, stage / HF_SUBDIR)
        if not (stage / HF_SUBDIR / "config.json").is_file():
            shutil.copy2(hf_dir / "config.json", stage / HF_SUBDIR / "config.json")
    return out
