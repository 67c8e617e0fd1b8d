"""Fault injection for the fault suite (tests/faults, docs/faults.md), in one module: every hook is an
environment variable read here and nowhere else, so what a test can break, and where, is one file to read.

- `MCORE_RL_CRASH_AT=<point>[:<update>]`: `crash_point` SIGKILLs the process there (no cleanup, like a node
  crash) at during_shards, after_complete, between_swap, after_rename, after_latest or during_prune, so crash
  tests kill at exact save points instead of racing a timer.
- `MCORE_RL_FSYNC_LOG=<file>`: `log_fsync` appends `<inode> <path>` for every fsync (the inode survives the
  renames that follow); a test simulates power loss by truncating every file that was never fsynced.
- `MCORE_RL_INJECT_NAN_AT=2[,3][@rank]`: `nan_at` makes the loss NaN at those 1-based updates (on one rank
  only with @rank); the non-finite guard must skip the step on every rank.
- `MCORE_RL_FAULT_REWARD=crash|alloc`: every reward case kills its worker, or allocates without bound
  (`act_reward_fault`); the worker pool must replace the worker.

Unset, every hook is a no-op costing one environment lookup.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

CRASH_ENV = "MCORE_RL_CRASH_AT"
FSYNC_LOG_ENV = "MCORE_RL_FSYNC_LOG"
NAN_ENV = "MCORE_RL_INJECT_NAN_AT"
REWARD_ENV = "MCORE_RL_FAULT_REWARD"
REWARD_FAULTS = ("crash", "alloc")


def crash_point(name: str, step: int | None = None) -> None:
    """Die here (SIGKILL) when MCORE_RL_CRASH_AT is `name` or `name:step`."""
    want = os.environ.get(CRASH_ENV)
    if not want:
        return
    point, _, at = want.partition(":")
    if point == name and (not at or (step is not None and int(at) == step)):
        os.kill(os.getpid(), signal.SIGKILL)


def log_fsync(path: str | Path) -> None:
    """Record an fsync of `path` when MCORE_RL_FSYNC_LOG names a file."""
    log = os.environ.get(FSYNC_LOG_ENV)
    if log:
        with open(log, "a") as f:
            f.write(f"{os.stat(path).st_ino} {os.path.abspath(path)}\n")


def nan_at(update_index: int | None) -> bool:
    """True when this rank's loss is to be NaN at this (1-based) update."""
    spec = os.environ.get(NAN_ENV)
    if not spec or update_index is None:
        return False
    updates, _, rank = spec.partition("@")
    if rank:
        import torch.distributed as dist

        if int(rank) != (dist.get_rank() if dist.is_initialized() else 0):
            return False
    return update_index in {int(x) for x in updates.split(",") if x.strip()}


def reward_fault() -> str | None:
    """The reward fault to inject (read by the pool's parent when it makes the workers' options)."""
    kind = os.environ.get(REWARD_ENV) or None
    if kind is not None and kind not in REWARD_FAULTS:
        raise ValueError(f"{REWARD_ENV}={kind!r}: expected one of {REWARD_FAULTS}")
    return kind


def act_reward_fault(kind: str) -> None:
    """In a reward worker, on every case: exit at once (`crash`), or allocate up to the memory limit
    (`alloc`)."""
    if kind == "crash":
        os._exit(3)
    if kind == "alloc":
        hog = []
        while True:
            hog.append(bytearray(64 * 2**20))
