"""Megatron dist-checkpoint (torch_dist) I/O for the policy, written atomically and durably, verified on load.

A checkpoint directory is written as `<name>.tmp`, every file is fsynced, a `complete.json` manifest (meta + every
file's size + a CRC32 of the small files) is written last, and only then is the folder renamed into place and its
parent fsynced (mcore_rl.fsio). So an interrupted save never looks finished, and after a power loss a "complete"
checkpoint cannot hold empty files unnoticed: `verify_checkpoint` compares the manifest with what is on disk.

A failed write (disk full) is agreed on by every rank with one all-reduce, so all ranks raise the same clear error
at once instead of waiting in the next collective; the temp folder is removed and the previous checkpoint stays.
Loading reshards to whatever TP/PP the loading job uses.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from mcore_rl import fsio
from mcore_rl.agreement import FatalRunError, any_rank
from mcore_rl.distributed import barrier, global_rank
from mcore_rl.faults import crash_point

log = logging.getLogger("mcore_rl")

COMPLETE = "complete.json"
FILES_KEY = "_files"
OPTIMIZER_SAVED = "optimizer_saved"  # false: saved before the first optimizer step (see optimizer_has_state)
SMALL_FILE = 1 << 20  # files up to this size also get a CRC32 in the manifest (the big shards: size only)
DISK_FULL_BYTES = 1 << 20  # less free space than this after a failed write: report the disk as full


class CheckpointWriteError(FatalRunError):
    """Saving failed on some rank (e.g. ENOSPC); raised on every rank."""


def _barrier() -> None:
    barrier()  # the gloo world group: a host-side meeting point, no device tensor involved


def _use_in_process_results_queue() -> None:
    """Synchronous saves collect writer results in this process: a thread queue replaces Megatron's
    spawn-context Manager, which costs seconds per process and re-imports `__main__` (breaking unguarded scripts)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    if fa._results_queue is None:
        fa._results_queue = queue.Queue()


def is_complete(path: str | Path) -> bool:
    return (Path(path) / COMPLETE).is_file()


def _crc32(path: Path) -> int:
    return zlib.crc32(path.read_bytes()) & 0xFFFFFFFF


def file_manifest(folder: Path) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != COMPLETE:
            size = p.stat().st_size
            entry = {"size": size}
            if size <= SMALL_FILE:
                entry["crc32"] = _crc32(p)
            out[str(p.relative_to(folder))] = entry
    return out


def verify_checkpoint(path: str | Path) -> str | None:
    """None when `path` is complete and every file matches its manifest entry; else why not (one line)."""
    p = Path(path)
    if not is_complete(p):
        return f"{p}: no {COMPLETE}"
    try:
        manifest = json.loads((p / COMPLETE).read_text()).get(FILES_KEY, {})
    except (OSError, ValueError, AttributeError) as e:
        return f"{p}/{COMPLETE} unreadable ({type(e).__name__}: {e})"
    for rel, entry in manifest.items():
        f = p / rel
        if not f.is_file():
            return f"{f} missing"
        size = f.stat().st_size
        if size != entry["size"]:
            return f"{f} has {size} bytes, manifest says {entry['size']}"
        if "crc32" in entry and _crc32(f) != entry["crc32"]:
            return f"{f} fails its CRC32 check"
    return None


_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    return sorted((int(m.group(1)), p) for p in root.glob("step_*") if (m := _STEP_DIR.match(p.name)))


def latest_checkpoint(ckpt_root: str | Path, report: bool = False) -> Path | None:
    """The newest checkpoint that verifies: the `latest` pointer's target first, then step dirs newest first.
    `report`: log each rejected step with the reason (the resume path does; status queries stay quiet)."""
    root = Path(ckpt_root)
    candidates: list[Path] = []
    pointer = root / "latest"
    if pointer.is_file():
        candidates.append(root / pointer.read_text().strip())
    candidates += [p for _, p in reversed(step_dirs(root)) if p not in candidates]
    for cand in candidates:
        why = verify_checkpoint(cand)
        if why is None:
            return cand
        if report and cand.exists():
            log.warning("checkpoint %s rejected: %s; trying the next older one", cand.name, why)
    return None


def model_sharded_state_dict(model) -> dict:
    """The model's dist-checkpoint entries; a LoRA policy's are its adapters only (its frozen base is the HF
    folder the checkpoint's meta names by path and hash, loaded from there on resume)."""
    from mcore_rl.policy.build import unwrap
    from mcore_rl.policy.lora import adapter_entries, has_adapters

    sd = unwrap(model).sharded_state_dict(prefix="")
    return adapter_entries(sd) if has_adapters(model) else sd


# The distributed optimizer's checkpoint format. Megatron-Core 0.16.1 defaults to `fully_sharded_model_space`, whose
# flat per-rank slices (`ShardedTensor.flattened_range`) its own dist_checkpointing now refuses ("flattened_range is
# not supported"); `dp_reshardable` saves the raw DP buffers, loadable only at the same TP/PP/EP. `fully_reshardable`
# gathers each DP group's optimizer state into model-shaped tensors keyed by the parameter's canonical key (like the
# plain optimizer): the format Megatron reshards across layouts. Plain optimizers ignore the key.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def optimizer_has_state(optimizer) -> bool:
    """Whether the optimizer has taken a step on any rank (Adam creates its moments at the first one). Before
    that there is nothing of it to save, and the sharded dict Megatron builds for *loading* names moments a
    step-0 save never wrote: a checkpoint taken before the first update (a preemption during the first rollout)
    saves no optimizer entries and loads none; the fresh optimizer it resumes with is the saved one."""
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    local = any(len(getattr(getattr(o, "optimizer", o), "state", {})) > 0 for o in inner)
    return any_rank(local)  # the save is collective: every rank must build the same entries


def optimizer_sharded_state_dict(optimizer, model_sd: dict, is_loading: bool = False) -> dict:
    """The optimizer's dist-checkpoint entries in a format that saves (see OPTIMIZER_METADATA) and reshards."""
    from mcore_rl.compat import distopt

    distopt.apply()  # torch-Adam fallback fixes of the distributed optimizer's save/resume
    return optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=dict(OPTIMIZER_METADATA))


def _fsync_own_files(tmp: Path, rank: int) -> None:
    """Each rank makes its own shard files durable (on a shared filesystem only the writer's client can)."""
    for f in tmp.iterdir():
        if f.is_file() and (f.name.startswith(f"__{rank}_") or f.name == f"rank_{rank:05d}.pt"):
            fsio.fsync_file(f)


def _one_line(e: BaseException) -> str:
    """DCP wraps a writer's error in a multi-line CheckpointException: its last line is the cause."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _fail(final: Path, tmp: Path, err: str | None) -> None:
    """Every rank raises the same error; rank 0 removes the partial folder. Writers often mask ENOSPC (torch's
    zip writer reports "unexpected pos"), so the free space, measured before the cleanup, names the cause."""
    free = _free_bytes(final.parent)
    _barrier()  # everyone measured before the partial folder goes
    if global_rank() == 0:
        fsio.discard(tmp)
    _barrier()
    why = err or "another rank failed to write its part"
    if free is not None and free < DISK_FULL_BYTES:
        why = f"disk full ({free} bytes free on {final.parent}) - {why}"
    raise CheckpointWriteError(f"checkpoint save to {final} failed on rank {global_rank()}: {why}; "
                               f"the previous checkpoint is intact and {tmp.name} was removed")


def save_dist_checkpoint(
    path: str | Path,
    model,
    optimizer=None,
    extra_sharded: dict | None = None,
    meta: dict[str, Any] | None = None,
    overwrite: bool = False,
    rank_state: dict[str, Any] | None = None,
    step: int | None = None,
) -> Path:
    """Save model (+ optimizer) shards from every rank into `path`, atomically and durably. Collective call.

    `rank_state`: per-rank extras (RNG states, EWMA shards, ...) saved as `rank_XXXXX.pt` inside the same
    atomic directory; load them back with `load_rank_state` (weights_only, so keep them to tensors/containers).
    `step` only names the save for the crash-test hooks (mcore_rl.faults.crash_point).
    """
    from megatron.core import dist_checkpointing

    final = Path(path)
    tmp = fsio.staging_path(final)
    err = None
    if global_rank() == 0:
        try:
            fsio.prepare_staging(final, overwrite=overwrite)
        except OSError as e:  # FileExistsError included: every rank must hear of it, not only rank 0
            err = f"{type(e).__name__}: {e}"
    if any_rank(err is not None):
        _fail(final, tmp, err)
    sharded = {"model": model_sharded_state_dict(model)}
    with_optimizer = optimizer is not None and optimizer_has_state(optimizer)
    if with_optimizer:
        sharded["optimizer"] = optimizer_sharded_state_dict(optimizer, sharded["model"])
    if extra_sharded:
        sharded.update(extra_sharded)
    _use_in_process_results_queue()
    try:
        dist_checkpointing.save(sharded, str(tmp))
        crash_point("during_shards", step)
        if rank_state is not None:
            torch.save(rank_state, tmp / f"rank_{global_rank():05d}.pt")
        _fsync_own_files(tmp, global_rank())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - ENOSPC arrives as OSError or wrapped by DCP
        err = _one_line(e)
    if any_rank(err is not None):  # one all-reduce: every rank learns of any rank's failure at once
        _fail(final, tmp, err)
    if global_rank() == 0:
        try:
            record = {**(meta or {}), OPTIMIZER_SAVED: with_optimizer, FILES_KEY: file_manifest(tmp)}
            fsio.write_file_atomic(tmp / COMPLETE, json.dumps(record, indent=2, default=str))
            crash_point("after_complete", step)
            fsio.commit_staging(tmp, final, on_swap=lambda: crash_point("between_swap", step))
        except OSError as e:
            err = f"{type(e).__name__}: {e}"
    if any_rank(err is not None):
        _fail(final, tmp, err)
    return final


def load_dist_checkpoint(path: str | Path, model, optimizer=None, extra_sharded: dict | None = None) -> dict:
    """Load (resharding to the current TP/PP) into model (+ optimizer). Returns the checkpoint's meta dict."""
    from megatron.core import dist_checkpointing

    from mcore_rl.policy.build import unwrap

    p = Path(path)
    if not is_complete(p):
        raise FileNotFoundError(f"{p} is not a complete mcore-rl checkpoint (no {COMPLETE}); refusing to load it")
    meta = json.loads((p / COMPLETE).read_text())
    if not meta.get(OPTIMIZER_SAVED, True):  # saved before the first step: the fresh optimizer is that state
        optimizer = None
    sharded = {"model": model_sharded_state_dict(model)}
    if optimizer is not None:
        sharded["optimizer"] = optimizer_sharded_state_dict(optimizer, sharded["model"], is_loading=True)
    if extra_sharded:
        sharded.update(extra_sharded)
    state = dist_checkpointing.load(sharded, str(p))
    from mcore_rl.policy.lora import has_adapters
    from mcore_rl.policy.lora_state import load_adapter_entries

    if has_adapters(model):
        load_adapter_entries(model, state["model"])
    else:
        unwrap(model).load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    state.pop("model", None)
    state.pop("optimizer", None)
    meta.pop(FILES_KEY, None)
    meta["_extra"] = state
    _barrier()
    return meta


def load_rank_state(path: str | Path) -> dict[str, Any] | None:
    f = Path(path) / f"rank_{global_rank():05d}.pt"
    return torch.load(f, weights_only=True) if f.is_file() else None

