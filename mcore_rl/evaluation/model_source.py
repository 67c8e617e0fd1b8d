"""What `mcore-rl-eval MODEL` points at -> an HF folder the rollout engine can load.

    HF folder (config.json)         used as is
    run directory (config.yaml)     its `hf/` export; or, with --checkpoint (or when there is no export), its
                                    latest complete checkpoint, exported to HF first
    Megatron checkpoint (complete.json)  exported to HF first (mcore_rl.convert.mcore_to_hf); the HF config and
                                    tokenizer come from --hf-config, the checkpoint's own hf/ copy, or - for a
                                    training checkpoint inside a run directory - the run's model
Why export instead of loading Megatron weights into the engine: the embedded engine and SGLang both load HF
folders; the converter is the one tested path between the two layouts.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


class ModelSourceError(ValueError):
    """MODEL cannot be resolved; one line naming the path."""


@dataclass
class ResolvedModel:
    hf_dir: Path
    kind: str  # hf | run_hf | run_checkpoint | checkpoint
    origin: Path
    tokenizer_dir: Path


def _run_model_dir(run_dir: Path) -> Path:
    """The model a run was started from, read from the config.yaml the trainer writes into its run dir."""
    from omegaconf import OmegaConf

    from mcore_rl.models.source import resolve_model_dir

    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file():
        raise ModelSourceError(f"{run_dir}: no config.yaml, so the run's base model (HF config, tokenizer) is "
                               "unknown; pass --hf-config")
    return resolve_model_dir(OmegaConf.load(cfg_file).model)


def _export(ckpt: Path, hf_config: Path | None, out_root: Path | None) -> Path:
    from mcore_rl.convert.common import ConvertError
    from mcore_rl.convert.mcore_to_hf import mcore_to_hf

    root = Path(out_root) if out_root else Path(tempfile.mkdtemp(prefix="mcore_rl_eval_"))
    out = root / f"hf_{ckpt.name}"
    if (out / "config.json").is_file():
        return out
    try:
        return mcore_to_hf(ckpt, out, hf_config=hf_config, progress=False)
    except ConvertError as e:
        raise ModelSourceError(f"{ckpt}: export to HF failed: {e}") from None


def resolve_model(model: str | Path, hf_config: str | Path | None = None, use_checkpoint: bool = False,
                  export_dir: str | Path | None = None) -> ResolvedModel:
    from mcore_rl.checkpoint_io import COMPLETE, latest_checkpoint

    p = Path(model)
    if not p.exists():
        raise ModelSourceError(f"{p}: no such file or directory")
    cfg_dir = Path(hf_config) if hf_config else None
    if (p / "config.json").is_file() and not (p / COMPLETE).is_file():
        return ResolvedModel(p, "hf", p, p)
    if (p / "config.yaml").is_file() or (p / "checkpoints").is_dir() or (p / "eval.jsonl").is_file():
        if not use_checkpoint and (p / "hf" / "config.json").is_file():
            return ResolvedModel(p / "hf", "run_hf", p, p / "hf")
        ckpt = latest_checkpoint(p / "checkpoints")
        if ckpt is None:
            raise ModelSourceError(f"{p}: run directory without an hf/ export or a complete checkpoint")
        cfg_dir = cfg_dir or _run_model_dir(p)
        return ResolvedModel(_export(ckpt, cfg_dir, export_dir), "run_checkpoint", ckpt, cfg_dir)
    if (p / COMPLETE).is_file():
        if cfg_dir is None and not (p / "hf" / "config.json").is_file():
            run_dir = p.parent.parent  # <run>/checkpoints/step_N
            cfg_dir = _run_model_dir(run_dir) if (run_dir / "config.yaml").is_file() else None
        hf = _export(p, cfg_dir, export_dir)
        return ResolvedModel(hf, "checkpoint", p, cfg_dir or p / "hf")
    raise ModelSourceError(f"{p}: not an HF folder (config.json), a run directory (config.yaml, checkpoints/) "
                           "or a complete Megatron checkpoint (complete.json)")
