"""Saving and resuming a run: the run state's counters, the policy (model, optimizer, LR schedule, RNG), and the
state each stateful component keeps (data cursor, algorithm and compute state, EWMA weights, the schedule's rounds
in flight, the old-log-prob source's stored versions). The file format and its crash safety: trainer/state.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from mcore_rl.config import TrainerConfig
from mcore_rl.distributed import broadcast_object
from mcore_rl.trainer.state import (
    RunState,
    latest_checkpoint,
    latest_update,
    load_checkpoint,
    save_checkpoint,
    sweep_stale,
)
from mcore_rl.trainer.weights import WeightSync

log = logging.getLogger("mcore_rl")


class Checkpointer:
    """`data`, `compute` exist on rank 0 only (None elsewhere); `ewma` only for PPO-EWMA. `from_mcore_ckpt`: the
    policy started from a Megatron checkpoint (model.mcore_ckpt), so the engine must be given those weights."""

    def __init__(
        self,
        run_dir: Path,
        settings: TrainerConfig,
        rank: int,
        policy: Any,
        algorithm: Any,
        schedule: Any,
        oldlogp: Any,
        weights: WeightSync,
        ewma: Any = None,
        data: Any = None,
        compute: Any = None,
        from_mcore_ckpt: bool = False,
    ) -> None:
        self.run_dir, self.root, self.settings, self.rank = run_dir, run_dir / "checkpoints", settings, rank
        self.policy, self.algorithm, self.schedule, self.oldlogp = policy, algorithm, schedule, oldlogp
        self.weights, self.ewma, self.data, self.compute = weights, ewma, data, compute
        self.from_mcore_ckpt = from_mcore_ckpt

    def save(self, state: RunState) -> Path:
        """Collective. The counters and rank 0's component state go into the JSON meta; per rank the EWMA
        weights, and on rank 0 the schedule's in-flight rounds (large: prompt ids, seeds, finished samples)."""
        meta = state.saved()
        if self.rank == 0:
            meta.update(
                data=self.data.state_dict(),
                algorithm=self.algorithm.state_dict(),
                compute=self.compute.state_dict(),
            )
        extra: dict[str, Any] = {"ewma": self.ewma.state_dict()} if self.ewma is not None else {}
        if self.rank == 0:
            extra["schedule"] = self.schedule.state_dict()
        if self.oldlogp.state_dict():  # stored weight versions of the samples still in flight
            extra["oldlogp"] = self.oldlogp.state_dict()
        return save_checkpoint(
            self.root,
            state.update,
            self.policy,
            broadcast_object(meta),
            rank_extra=extra,
            keep=self.settings.keep_checkpoints,
        )

    def maybe_save(self, state: RunState, updates_this_round: int, stopping: bool) -> None:
        """After a round: when it crossed a multiple of trainer.save_every, or a stop was requested."""
        every = self.settings.save_every
        crossed = every > 0 and (state.update // every) > ((state.update - updates_this_round) // every)
        if crossed or stopping:
            self.save(state)

    def save_final(self, state: RunState, stop_signals: list[int] | None) -> None:
        """At the end: the last update saved unless it already is. `stop_signals`: the signals that stopped a
        preempted run (None: it finished), recorded in run.dir/PREEMPTED."""
        preempted = stop_signals is not None
        if (preempted or state.update > 0) and latest_update(self.root) != state.update:
            self.save(state)
        if preempted and self.rank == 0:
            (self.run_dir / "PREEMPTED").write_text(
                json.dumps({"update": state.update, "signals": stop_signals})
            )

    def restore(self, state: RunState) -> None:
        """Continue from the newest verified checkpoint (trainer.resume=auto) or start fresh; then the engine
        holds the policy's weights and the old-log-prob source knows the live version."""
        if self.rank == 0:
            sweep_stale(self.root)
        ckpt = latest_checkpoint(self.root, report=True) if self.settings.resume == "auto" else None
        extra: dict[str, Any] = {}
        if ckpt is not None:
            meta, extra = load_checkpoint(ckpt, self.policy)
            saved = meta["trainer"]
            state.restore(saved)
            if self.ewma is not None and "ewma" in extra:
                self.ewma.load_state_dict(extra["ewma"])
            if self.rank == 0:
                self.data.load_state_dict(saved["data"])
            if saved.get("algorithm") is not None:
                self.algorithm.load_state_dict(saved["algorithm"])
            if self.compute is not None and saved.get("compute"):
                self.compute.load_state_dict(saved["compute"])
            log.warning("resumed from %s at update %d", ckpt, state.update)
        if ckpt is not None or self.from_mcore_ckpt:
            self.weights.reload(state.version)
        if self.rank == 0:
            if extra.get(
                "schedule"
            ):  # after the reload: requests still to generate use the checkpoint's weights
                self.schedule.load_state_dict(extra["schedule"])
            (self.run_dir / "PREEMPTED").unlink(missing_ok=True)
        if extra.get("oldlogp"):  # the versions restored in-flight samples were generated with
            self.oldlogp.load_state_dict(extra["oldlogp"])
        self.weights.announce(state.version)
