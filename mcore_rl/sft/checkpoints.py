"""SFT checkpoints: RL's crash-consistent step folders (trainer/state.py) with SFT's counters in the meta.

A step folder holds the model, optimizer, LR schedule and every rank's RNG; the SFT cursor is the step count alone
(run.step_rows maps a step to its rows), plus when the next held-out evaluation is due. The model part is what
RL's `model.mcore_ckpt` loads (checkpoint_io.load_dist_checkpoint without an optimizer), so RL can start from
`run.dir/checkpoints/step_NNNNNN` as well as from the HF export.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mcore_rl.trainer.state import (
    latest_checkpoint,
    latest_update,
    load_checkpoint,
    save_checkpoint,
    sweep_stale,
)

log = logging.getLogger("mcore_rl")


def _root(run: Any) -> Path:
    return run.run_dir / "checkpoints"


def save(run: Any) -> Path:
    """Collective: step folder `step_{run.step:06d}`, then the `latest` pointer, then pruning."""
    meta = {"sft": {"step": run.step, "next_eval": run.next_eval, "train_rows": len(run.train)}}
    return save_checkpoint(_root(run), run.step, run.policy, meta, keep=run.cfg.sft.keep_checkpoints)


def saved_step(run: Any) -> int | None:
    return latest_update(_root(run))


def restore(run: Any) -> None:
    """Continue from the newest verified checkpoint (sft.resume=auto), or start fresh."""
    root = _root(run)
    if run.rank == 0:
        sweep_stale(root)
    ckpt = latest_checkpoint(root, report=True) if run.cfg.sft.resume == "auto" else None
    if ckpt is None:
        return
    meta, _ = load_checkpoint(ckpt, run.policy)
    saved = meta["trainer"]["sft"]
    if int(saved["train_rows"]) != len(run.train):
        from mcore_rl.config import ConfigError

        raise ConfigError(
            f"{ckpt}: saved with {saved['train_rows']} train rows, this run has {len(run.train)}; "
            "the data changed (sft.resume=never or a new run.dir starts over)"
        )
    run.step, run.next_eval = int(saved["step"]), int(saved["next_eval"])
    log.warning("resumed from %s at step %d", ckpt, run.step)
