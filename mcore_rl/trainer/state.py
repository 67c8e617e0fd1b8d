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
    if policy.scheduler is not None and meta.get("scheduler"):
        policy.scheduler.load_state_dict(meta["scheduler"])
    extra = load_rank_state(path) or {}
    if "rng" in extra:
        set_rng_state(extra.pop("rng"))
    return meta, extra


def latest_update(ckpt_root: str | Path) -> int | None:
    ck = latest_checkpoint(ckpt_root)
    return int(ck.name.split("_")[1]) if ck else None


def trainer_state(run) -> dict[str, Any]:
    """The JSON part of a run's state (rank 0's view): counters, data cursor, algorithm and compute state."""
    st = {"update": run.update, "round": run.round, "version": run.version, "next_eval": run.next_eval}
    if run.rank == 0:
        st["data"] = run.data.state_dict()  # after every round in flight: the schedule's state lists those
        st["algorithm"] = run.algorithm.state_dict()
        st["compute"] = run.compute.state_dict()
    return st


def checkpoint(run) -> Path:
    """Collective. Per rank: EWMA weights; rank 0 also the schedule's in-flight rounds (prompt ids, seeds and
    the samples of finished requests), which can be large, so they go to the rank file, not the JSON meta."""
    from mcore_rl.distributed import broadcast_object

    extra = {"ewma": run.ewma.state_dict()} if run.ewma is not None else {}
    if run.rank == 0:
        extra["schedule"] = run.schedule.state_dict()
    oldlogp = getattr(run, "oldlogp", None)
    if oldlogp is not None and oldlogp.state_dict():  # stored weight versions of the samples still in flight
        extra["oldlogp"] = oldlogp.state_dict()
    return save_checkpoint(run.ckpt_root, run.update, run.policy, broadcast_object(trainer_state(run)),
                           rank_extra=extra, keep=run.cfg.trainer.keep_checkpoints)


def resume_or_start(run) -> None:
    """Continue from the newest verified checkpoint (trainer.resume=auto) or start; then sync the engine."""
    if run.rank == 0:
        sweep_stale(run.ckpt_root)
    ckpt = latest_checkpoint(run.ckpt_root, report=True) if run.cfg.trainer.resume == "auto" else None
    need_sync = bool(run.cfg.model.mcore_ckpt)
    extra: dict[str, Any] = {}
    if ckpt is not None:
        meta, extra = load_checkpoint(ckpt, run.policy)
        t = meta["trainer"]
        run.update, run.round, run.version, run.next_eval = t["update"], t["round"], t["version"], t["next_eval"]
        if run.ewma is not None and "ewma" in extra:
            run.ewma.load_state_dict(extra["ewma"])
        if run.rank == 0:
            run.data.load_state_dict(t["data"])
        if t.get("algorithm") is not None:
            run.algorithm.load_state_dict(t["algorithm"])
        if run.compute is not None and t.get("compute"):
            run.compute.load_state_dict(t["compute"])
        log.warning("resumed from %s at update %d", ckpt, run.update)
        need_sync = True
    run.resumed_oldlogp = extra.get("oldlogp")  # loaded once the old-log-prob source exists (run.py)
    if need_sync:
        run.sync_weights(bump=False)
    if run.rank == 0:
        if extra.get("schedule"):  # after the sync: requests still to generate use the checkpoint's weights
            run.schedule.load_state_dict(extra["schedule"])
        (run.run_dir / "PREEMPTED").unlink(missing_ok=True)
        from omegaconf import OmegaConf

        (run.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(run.cfg, resolve=True))
