"""Checkpoint everything a run needs to continue exactly: model, optimizer, LR schedule, RNG, data cursor, step,
algorithm state (EWMA weights, pass-rate history).

Crash-consistent: each checkpoint dir is renamed into place complete and durable, the `latest` pointer is replaced
(and fsynced) after it, and old steps are pruned last by first renaming them out of the `step_*` namespace. So a
crash at any point leaves a usable checkpoint. On resume, a step that fails verification (sizes/CRC against its
manifest: e.g. files emptied by a power loss, or bit rot) is reported and the next older verified step is used.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mcore_rl import fsio
from mcore_rl.agreement import any_rank
from mcore_rl.checkpoint_io import (
    CheckpointWriteError,
    latest_checkpoint,
    load_dist_checkpoint,
    load_rank_state,
    save_dist_checkpoint,
    step_dirs,
)
from mcore_rl.distributed import global_rank
from mcore_rl.faults import crash_point

log = logging.getLogger("mcore_rl")


@dataclass
class RunState:
    """The run's counters, the only mutable state the loop shares with its components (schedules read `round`
    and `version`). `update`..`next_eval` are saved in every checkpoint and restored on resume."""

    update: int = 0                 # optimizer updates done
    round: int = 0                  # rounds consumed
    version: int = 0                # weight version the engine holds
    next_eval: int = 0              # the update at which the next periodic held-out evaluation is due
    last_eval: int | None = None    # the update last evaluated (one evaluation per update at most)

    def saved(self) -> dict[str, int]:
        return {"update": self.update, "round": self.round, "version": self.version, "next_eval": self.next_eval}

    def restore(self, saved: dict[str, Any]) -> None:
        self.update, self.round = int(saved["update"]), int(saved["round"])
        self.version, self.next_eval = int(saved["version"]), int(saved["next_eval"])


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


def sweep_stale(ckpt_root: str | Path) -> list[Path]:
    """Rank 0 at start: remove `.tmp`/`.old` leftovers of a save or prune that a crash interrupted."""
    gone = fsio.sweep_stale(ckpt_root)
    for p in gone:
        log.warning("removed stale checkpoint leftover %s", p)
    return gone


def save_checkpoint(ckpt_root: str | Path, update: int, policy, trainer_state: dict[str, Any],
                    rank_extra: dict[str, Any] | None = None, keep: int = 2) -> Path:
    """Collective. `trainer_state` (JSON-able, rank 0's view) goes into the meta; `rank_extra` per rank."""
    root = Path(ckpt_root)
    path = root / f"step_{update:06d}"
    meta = {"update": update, "trainer": trainer_state,
            "scheduler": policy.scheduler.state_dict() if policy.scheduler else None}
    from mcore_rl.policy.lora_state import base_reference

    if (base := base_reference(policy)) is not None:
        meta["lora_base"] = base  # a LoRA checkpoint holds adapters + optimizer only; the base is referenced
    rank_state = {"rng": rng_state(), **(rank_extra or {})}
    save_dist_checkpoint(path, policy.model, policy.optimizer, meta=meta, overwrite=True, rank_state=rank_state,
                         step=update)
    crash_point("after_rename", update)
    err = None
    if global_rank() == 0:
        try:
            fsio.write_file_atomic(root / "latest", path.name)
            crash_point("after_latest", update)
            for _, old in step_dirs(root)[:-keep] if keep > 0 else []:
                fsio.remove_tree(old, on_renamed=lambda: crash_point("during_prune", update))
        except OSError as e:
            err = f"{type(e).__name__}: {e}"
    if any_rank(err is not None):  # also the closing sync point: every rank hears of rank 0's failure
        raise CheckpointWriteError(f"checkpoint {path.name} was saved but updating {root / 'latest'} or pruning "
                                   f"failed: {err or 'on rank 0'}; a restart resumes from the newest verified step")
    return path


def load_checkpoint(path: str | Path, policy) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore model + optimizer + scheduler + RNG. Returns (meta, this rank's extra state)."""
    meta = load_dist_checkpoint(path, policy.model, policy.optimizer)
    from mcore_rl.policy.lora_state import check_base

    check_base(policy, meta.get("lora_base"))
    if policy.scheduler is not None and meta.get("scheduler"):
        policy.scheduler.load_state_dict(meta["scheduler"])
    extra = load_rank_state(path) or {}
    if "rng" in extra:
        set_rng_state(extra.pop("rng"))
    return meta, extra


def latest_update(ckpt_root: str | Path) -> int | None:
    ck = latest_checkpoint(ckpt_root)
    return int(ck.name.split("_")[1]) if ck else None
