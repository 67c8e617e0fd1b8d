"""The resumable queue's decisions: for every (arm, seed) run, skip it, finish its bookkeeping, resume it from its
checkpoint, or start it, from what its run directory holds.

Why a pure function over a small `RunState`: the queue runs for hours on a shared machine and gets interrupted
(preemption, a reboot, someone's Ctrl-C); what it does next must follow from the files alone, and that logic has to
be testable without running a model (tests/evaluation/test_exp_queue.py). `probe()` is the only part that reads
the disk.

The rules, in order:
  - a DONE marker for at least the requested updates      -> skip   (a finished arm is never re-run; the marker's
                                                             committed copy in data/ counts too)
  - the run exited 0 and its eval.jsonl reached the last update, but no marker (the queue died between the run and
    the marker)                                           -> finish (write the marker; nothing is re-run)
  - a verified checkpoint below the requested updates      -> resume (trainer.resume=auto picks it up)
  - leftovers but no checkpoint (died before the first save)-> restart (old records moved aside, start over)
  - nothing                                               -> start
The marker is written atomically (a temporary file renamed over it) after the arm's last eval, so a half-written
marker cannot exist.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

MARKER = "DONE.json"


@dataclass(frozen=True)
class RunState:
    """What one (arm, seed) run directory says about itself."""

    done_steps: int | None = None  # updates recorded in the DONE marker (None: no marker)
    checkpoint_update: int | None = None  # newest verified checkpoint's update (None: none)
    last_eval_step: int | None = None  # highest step in eval.jsonl (None: no records)
    last_rc: int | None = None  # exit status of the last segment in arm.json (None: never ran)
    has_files: bool = False  # anything in the run directory at all


@dataclass(frozen=True)
class Job:
    arm: str
    seed: int
    action: str  # skip | finish | resume | restart | start
    reason: str


def decide(state: RunState, steps: int) -> tuple[str, str]:
    """(action, reason) for a run that should reach `steps` updates."""
    if state.done_steps is not None and state.done_steps >= steps:
        return "skip", f"done ({state.done_steps} updates)"
    if state.last_rc == 0 and state.last_eval_step is not None and state.last_eval_step >= steps:
        return "finish", f"ran to {state.last_eval_step} updates, marker missing"
    if state.checkpoint_update is not None and state.checkpoint_update < steps:
        return "resume", f"checkpoint at update {state.checkpoint_update}"
    if state.checkpoint_update is not None:  # a checkpoint at/after `steps` but the final eval is missing
        return "resume", f"checkpoint at update {state.checkpoint_update}, final eval missing"
    if state.has_files:
        return "restart", "interrupted before its first checkpoint"
    return "start", "new"


def plan(arms: list[tuple[str, int]], seeds: list[int], states: dict[tuple[str, int], RunState]) -> list[Job]:
    """Every (arm, seed) in queue order: seeds outer, arms inner, so an interrupted queue has whole seeds of every
    arm (a comparison with 2 seeds per arm) rather than 3 seeds of the first arm and none of the last."""
    jobs = []
    for seed in seeds:
        for name, steps in arms:
            action, reason = decide(states.get((name, seed), RunState()), steps)
            jobs.append(Job(name, seed, action, reason))
    return jobs


def probe(run_dir: Path, committed: Path | None = None) -> RunState:
    """Read a run directory into a RunState (the trainer's own checkpoint verification decides what counts).
    `committed`: the marker's copy under the experiment's data/ (in git). It counts where the run directory has no
    marker of its own, above all where the directory is gone: run directories live outside the repository, and a
    queue continued on another machine or after a wiped disk must not re-run the arms its data/ already holds."""
    marker = run_dir / MARKER
    if not marker.is_file() and committed is not None and committed.is_file():
        marker = committed
    done = json.loads(marker.read_text())["steps"] if marker.is_file() else None
    if not run_dir.is_dir():
        return RunState(done_steps=done)
    ckpt = None
    if (run_dir / "checkpoints").is_dir():
        from mcore_rl.trainer.state import latest_update

        ckpt = latest_update(run_dir / "checkpoints")
    steps = [json.loads(x)["step"] for x in _lines(run_dir / "eval.jsonl")]
    meta = run_dir / "arm.json"
    segs = json.loads(meta.read_text())["segments"] if meta.is_file() else []
    return RunState(
        done_steps=done,
        checkpoint_update=ckpt,
        last_eval_step=max(steps, default=None),
        last_rc=segs[-1]["rc"] if segs else None,
        has_files=any(run_dir.iterdir()),
    )


def _lines(path: Path) -> list[str]:
    return [x for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def write_marker(run_dir: Path, payload: dict) -> None:
    """Atomically: a reader sees either no marker or the whole one."""
    tmp = run_dir / f".{MARKER}.tmp"
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, run_dir / MARKER)


def drop_checkpoints(run_dir: Path) -> None:
    """With MCORE_RL_EXP_DROP_CHECKPOINTS=1 (queue.sh sets it), a finished run (marker written) keeps only its
    records: its checkpoints (1.8-2.6 GB per SmolLM2 arm) go, or the whole queue would need ~150 GB and fill the
    disk part-way (it did, with ten runs kept). The price: such an arm cannot later be extended to more updates."""
    if os.environ.get("MCORE_RL_EXP_DROP_CHECKPOINTS") == "1":
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)


def set_aside(run_dir: Path) -> Path:
    """Move an interrupted run's leftovers (no checkpoint) to a numbered sibling, so a restart writes fresh records
    and nothing is deleted."""
    n = 1
    while (dest := run_dir.with_name(f"{run_dir.name}.interrupted{n}")).exists():
        n += 1
    run_dir.rename(dest)
    return dest
