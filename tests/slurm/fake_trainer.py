"""Stand-in for `mcore-rl-train` that honours the same Slurm contract, fast and without a model.

Why: preemption and requeue take many seconds of wall clock; the real trainer spends most of that importing
Megatron. This script keeps the parts train.sbatch relies on:
  * Hydra-style `key=value` arguments; `run.dir` is the output folder, `trainer.steps` the step count,
    `trainer.resume=auto` resumes from run.dir/checkpoints/latest.
  * one JSON line per step in run.dir/metrics.jsonl with key "step" (rank 0 only);
  * on SIGUSR1/SIGTERM: finish the step, checkpoint, write run.dir/PREEMPTED, exit 0;
  * on a normal finish: checkpoint, remove PREEMPTED, exit 0.
Extra key for the tests: `fake.step_s` (seconds per step). Every rank appends what it saw to
run.dir/ranks.jsonl. Only signal-plumbing tests use it; every contract test runs the real trainer.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

_stop = {"signal": 0}


def _on_signal(signum: int, _frame: object) -> None:
    _stop["signal"] = signum


def parse_overrides(argv: list[str]) -> dict[str, str]:
    """`a.b=c` pairs; anything else is a usage error (what Hydra would reject too)."""
    out: dict[str, str] = {}
    for arg in argv:
        key, sep, value = arg.lstrip("+").partition("=")
        if not sep or not key:
            sys.exit(f"fake_trainer: override {arg!r} is not key=value")
        out[key] = value
    return out


def read_latest(ckpt_dir: Path) -> int:
    latest = ckpt_dir / "latest"
    if not latest.exists():
        return 0
    name = latest.read_text().strip()
    return json.loads((ckpt_dir / name / "state.json").read_text())["step"]


def save_checkpoint(ckpt_dir: Path, step: int) -> None:
    """Atomic like the real one: write the folder, then flip the `latest` pointer."""
    name = f"step_{step}"
    (ckpt_dir / name).mkdir(parents=True, exist_ok=True)
    (ckpt_dir / name / "state.json").write_text(json.dumps({"step": step}))
    tmp = ckpt_dir / "latest.tmp"
    tmp.write_text(name)
    tmp.replace(ckpt_dir / "latest")


def main() -> int:
    signal.signal(signal.SIGUSR1, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    cfg = parse_overrides(sys.argv[1:])
    run_dir = Path(cfg["run.dir"])
    steps = int(cfg.get("trainer.steps", "3"))
    step_s = float(cfg.get("fake.step_s", "0.2"))
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ckpt_dir = run_dir / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    start = read_latest(ckpt_dir) if cfg.get("trainer.resume", "auto") == "auto" else 0

    seen = {
        "rank": rank,
        "world": world,
        "host": socket.gethostname(),
        "node": os.environ.get("SLURMD_NODENAME"),
        "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
        "start_step": start,
        "argv": sys.argv[1:],
    }
    with open(run_dir / "ranks.jsonl", "a") as f:
        f.write(json.dumps(seen) + "\n")

    step = start
    while step < steps and not _stop["signal"]:
        time.sleep(step_s)
        step += 1
        if rank == 0:
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "restart": seen["restart"], "time": time.time()}) + "\n")
    if rank == 0:
        save_checkpoint(ckpt_dir, step)
        marker = run_dir / "PREEMPTED"
        if step < steps:
            marker.write_text(f"signal {_stop['signal']} at step {step}\n")
        else:
            marker.unlink(missing_ok=True)
    print(f"fake_trainer rank {rank}: steps {start}->{step} of {steps}, signal {_stop['signal']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
