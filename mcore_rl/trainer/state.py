"""Checkpoint everything a run needs to continue exactly: model, optimizer, LR schedule, RNG, data cursor, step,
algorithm state (EWMA weights, pass-rate history). Atomic: each checkpoint dir is renamed into place complete, and
the `latest` pointer is replaced last, so a crash at any point leaves the previous checkpoint usable.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mcore_rl.checkpoint_io import is_complete, load_dist_checkpoint, load_rank_state, save_dist_checkpoint
from mcore_rl.distributed import global_rank

_STEP_DIR = re.compile(r"^step_(\d+)$")


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": list(np.random.get_state()[1].tolist()),
            "numpy_pos": int(np.random.get_state()[2]), "python": repr(random.getstate())}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(("MT19937", np.array(state["numpy"], dtype=np.uint32), state["numpy_pos"], 0, 0.0))
    import ast

    random.setstate(_to_tuple(ast.literal_eval(state["python"])))


def _to_tuple(x):
    return tuple(_to_tuple(i) for i in x) if isinstance(x, (list, tuple)) else x


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    root = Path(ckpt_root)
    pointer = root / "latest"
    if pointer.is_file():
        cand = root / pointer.read_text().strip()
        if is_complete(cand):
            return cand
    # pointer missing or stale: newest complete step dir
    steps = sorted((int(m.group(1)), p) for p in root.glob("step_*") if (m := _STEP_DIR.match(p.name)))
    for _, p in reversed(steps):
        if is_complete(p):
            return p
    return None


def save_checkpoint(ckpt_root: str | Path, update: int, policy, trainer_state: dict[str, Any],
                    rank_extra: dict[str, Any] | None = None, keep: int = 2) -> Path:
    """Collective. `trainer_state` (JSON-able, rank 0's view) goes into the meta; `rank_extra` per rank."""
    root = Path(ckpt_root)
    path = root / f"step_{update:06d}"
    meta = {"update": update, "trainer": trainer_state,
            "scheduler": policy.scheduler.state_dict() if policy.scheduler else None}
    rank_state = {"rng": rng_state(), **(rank_extra or {})}
    save_dist_checkpoint(path, policy.model, policy.optimizer, meta=meta, overwrite=True, rank_state=rank_state)
    if global_rank() == 0:
        tmp = root / "latest.tmp"
        tmp.write_text(path.name)
        os.replace(tmp, root / "latest")
        steps = sorted((int(m.group(1)), p) for p in root.glob("step_*") if (m := _STEP_DIR.match(p.name)))
        for _, old in steps[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return path


def load_checkpoint(path: str | Path, policy) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore model + optimizer + scheduler + RNG. Returns (meta, this rank's extra state)."""
    meta = load_dist_checkpoint(path, policy.model, policy.optimizer)
    if policy.scheduler is not None and meta.get("scheduler"):
        policy.scheduler.load_state_dict(meta["scheduler"])
    extra = load_rank_state(path) or {}
    if "rng" in extra:
        set_rng_state(extra.pop("rng"))
    return meta, extra
