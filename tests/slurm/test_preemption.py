"""Preemption on a real local Slurm: the running job checkpoints, is requeued, and its restart resumes.

Two ways in: `scancel --signal=USR1 --batch` (what `--signal=B:USR1@120` sends before the time limit; the
script forwards it and requeues itself) and `scontrol requeue` (Slurm sends TERM everywhere and requeues).
The stand-in trainer keeps it fast: the mechanics are the script's; the real trainer would spend the time
importing (its own version of this test is marked slow).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from .conftest import FAKE_TRAINER, FINAL_AFTER_REQUEUE, REAL_FAST, LocalSlurm, outcome
from .test_train_sbatch import read_jsonl

pytestmark = pytest.mark.slurm

STEPS = 20


def wait_for_steps(metrics: Path, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists() and len(read_jsonl(metrics)) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"{metrics} has fewer than {n} steps after {timeout}s")


def test_preempted_jobs_resume_where_they_stopped(slurm: LocalSlurm, tmp_path):
    """Both ways at once (one job per node, to halve the wall time)."""
    env = {"MCORE_RL_TRAIN_CMD": str(FAKE_TRAINER)}
    jobs = {how: slurm.sbatch(tmp_path, f"trainer.steps={STEPS}", "fake.step_s=0.4", env=env)
            for how in ("usr1", "requeue")}
    run_dirs = {how: tmp_path / "runs" / f"mcore-rl-{job}" for how, job in jobs.items()}
    for how, job in jobs.items():
        wait_for_steps(run_dirs[how] / "metrics.jsonl", 2, timeout=90)
        if how == "usr1":
            slurm.run("scancel", "--signal=USR1", "--batch", job)
        else:
            slurm.run("scontrol", "requeue", job)

    for how, job in jobs.items():
        info = slurm.wait(job, timeout=150, until=lambda i: i["JobState"] in FINAL_AFTER_REQUEUE)
        assert outcome(info) == ("COMPLETED", "0:0", "1"), slurm.log(info)
        run_dir = run_dirs[how]
        metrics = read_jsonl(run_dir / "metrics.jsonl")
        assert [m["step"] for m in metrics] == list(range(1, STEPS + 1)), how  # no step lost or repeated
        first = [m["step"] for m in metrics if m["restart"] == 0]
        assert 2 <= len(first) < STEPS, how  # stopped early, after the signal
        attempts = read_jsonl(run_dir / "ranks.jsonl")
        assert [(a["restart"], a["start_step"]) for a in attempts] == [(0, 0), (1, first[-1])], how
        assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{STEPS}"
        assert not (run_dir / "PREEMPTED").exists()
        requeued_itself = f"requeueing job {job}" in slurm.log(info)
        assert requeued_itself == (how == "usr1"), how  # after TERM the script leaves requeueing to Slurm


def test_requeue_cap(slurm: LocalSlurm, tmp_path):
    """MCORE_RL_MAX_REQUEUES=0: a preempted job checkpoints but is not requeued; it fails with exit 3."""
    env = {"MCORE_RL_TRAIN_CMD": str(FAKE_TRAINER), "MCORE_RL_MAX_REQUEUES": "0"}
    job = slurm.sbatch(tmp_path, f"trainer.steps={STEPS}", "fake.step_s=0.4", env=env)
    run_dir = tmp_path / "runs" / f"mcore-rl-{job}"
    wait_for_steps(run_dir / "metrics.jsonl", 2, timeout=90)
    slurm.run("scancel", "--signal=USR1", "--batch", job)
    info = slurm.wait(job, timeout=120)
    assert outcome(info) == ("FAILED", "3:0", "0"), slurm.log(info)
    assert "not requeueing: already requeued 0 times (MCORE_RL_MAX_REQUEUES=0)" in slurm.log(info)
    assert (run_dir / "PREEMPTED").exists()  # the checkpoint is there for a manual resubmit


def test_no_progress_is_not_requeued(slurm: LocalSlurm, tmp_path):
    """The REAL trainer stopped before its first update (time limit 2 min, stop lead 110 s: the stop comes while
    it starts up) is not requeued: requeueing it would repeat the same attempt forever."""
    env = {"MCORE_RL_STOP_LEAD_S": "110", "MCORE_RL_SIGNAL_RESEND_S": "1"}
    t0 = time.monotonic()
    # a first round of generation (~5 s) far longer than the 1 s re-send interval: the stop lands before update 1
    job = slurm.sbatch(tmp_path, *REAL_FAST, "trainer.steps=5", "trainer.max_new_tokens=1500", env=env,
                       options=("--time=2",))
    info = slurm.wait(job, timeout=240)
    print(f"no-progress job took {time.monotonic() - t0:.0f}s")
    log = slurm.log(info)
    assert outcome(info) == ("FAILED", "3:0", "0"), log  # Restarts=0: never requeued
    assert "the trainer is asked to stop in" in log and "time limit in 110s" in log
    assert "not requeueing: no update since this attempt began (checkpoint at update 0)" in log
    run_dir = tmp_path / "runs" / f"mcore-rl-{job}"
    assert not (run_dir / "metrics.jsonl").exists() or not read_jsonl(run_dir / "metrics.jsonl")
    assert json.loads((run_dir / "PREEMPTED").read_text())["update"] == 0


@pytest.mark.slow
def test_real_trainer_preempt_and_resume(slurm: LocalSlurm, tmp_path):
    """The real trainer honours the same contract: USR1 -> checkpoint + PREEMPTED + exit 0 -> resume."""
    steps = 30
    job = slurm.sbatch(tmp_path, *REAL_FAST, f"trainer.steps={steps}")
    run_dir = tmp_path / "runs" / f"mcore-rl-{job}"
    wait_for_steps(run_dir / "metrics.jsonl", 1, timeout=400)
    slurm.run("scancel", "--signal=USR1", "--batch", job)
    info = slurm.wait(job, timeout=600, until=lambda i: i["JobState"] in FINAL_AFTER_REQUEUE)
    assert outcome(info) == ("COMPLETED", "0:0", "1"), slurm.log(info)
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, steps + 1))
    assert not (run_dir / "PREEMPTED").exists()
