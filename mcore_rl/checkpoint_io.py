"""Megatron dist-checkpoint (torch_dist) I/O for the policy, written atomically.

A checkpoint directory is first written as `<name>.tmp` and renamed into place only after every rank finished and
a `complete` marker is inside, so an interrupted save can never look like a finished checkpoint. Loading reshards
to whatever TP/PP the loading job uses.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mcore_rl.distributed import global_rank

COMPLETE = "complete.json"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _use_in_process_results_queue() -> None:
    """Synchronous saves collect writer results in this process: a thread queue replaces Megatron's
    spawn-context Manager, which costs seconds per process and re-imports `__main__` (breaking unguarded scripts)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    if fa._results_queue is None:
        fa._results_queue = queue.Queue()


def is_complete(path: str | Path) -> bool:
    return (Path(path) / COMPLETE).is_file()


def model_sharded_state_dict(model) -> dict:
    from mcore_rl.policy.build import unwrap

    return unwrap(model).sharded_state_dict(prefix="")


def save_dist_checkpoint(
    path: str | Path,
    model,
    optimizer=None,
    extra_sharded: dict | None = None,
    meta: dict[str, Any] | None = None,
    overwrite: bool = False,
    rank_state: dict[str, Any] | None = None,
) -> Path:
    """Save model (+ optimizer) shards from every rank into `path`, atomically. Collective call.

    `rank_state`: per-rank extras (RNG states, EWMA shards, ...) saved as `rank_XXXXX.pt` inside the same
    atomic directory; load them back with `load_rank_state` (weights_only, so keep them to tensors/containers).
    """
    from megatron.core import dist_checkpointing

    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    if global_rank() == 0:
        if final.exists():
            if not overwrite:
                raise FileExistsError(f"checkpoint {final} exists; pass overwrite/--force to replace it")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    sharded = {"model": model_sharded_state_dict(model)}
    if optimizer is not None:
        sharded["optimizer"] = optimizer.sharded_state_dict(sharded["model"])
    if extra_sharded:
        sharded.update(extra_sharded)
    _use_in_process_results_queue()
    dist_checkpointing.save(sharded, str(tmp))
    if rank_state is not None:
        torch.save(rank_state, tmp / f"rank_{global_rank():05d}.pt")
    _barrier()
    if global_rank() == 0:
        (tmp / COMPLETE).write_text(json.dumps(meta or {}, indent=2, default=str))
        if final.exists():
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    _barrier()
    return final


def load_dist_checkpoint(path: str | Path, model, optimizer=None, extra_sharded: dict | None = None) -> dict:
    """Load (resharding to the current TP/PP) into model (+ optimizer). Returns the checkpoint's meta dict."""
    from megatron.core import dist_checkpointing

    from mcore_rl.policy.build import unwrap

    p = Path(path)
    if not is_complete(p):
        raise FileNotFoundError(f"{p} is not a complete mcore-rl checkpoint (no {COMPLETE}); refusing to load it")
    sharded = {"model": model_sharded_state_dict(model)}
    if optimizer is not None:
        sharded["optimizer"] = optimizer.sharded_state_dict(sharded["model"], is_loading=True)
    if extra_sharded:
        sharded.update(extra_sharded)
    state = dist_checkpointing.load(sharded, str(p))
    unwrap(model).load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    state.pop("model", None)
    state.pop("optimizer", None)
    meta = json.loads((p / COMPLETE).read_text())
    meta["_extra"] = state
    _barrier()
    return meta


def load_rank_state(path: str | Path) -> dict[str, Any] | None:
    f = Path(path) / f"rank_{global_rank():05d}.pt"
    return torch.load(f, weights_only=True) if f.is_file() else None
