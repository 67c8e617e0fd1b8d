"""The training entry point end to end on the tiny model's task (tests/e2e/sevens.py: rewards vary, so updates
train): single process, torchrun TP=2, resume, multirun over the algorithms, errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_train_batch
from tests.e2e.sevens import TINY_TASK, assert_trains

pytestmark = pytest.mark.e2e

FAST = [*TINY_TASK, "eval.num_prompts=4", "eval.samples_per_prompt=2", "trainer.prompts_per_update=2",
        "trainer.samples_per_prompt=4", "trainer.max_new_tokens=8", "logging.progress=false"]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}


def train_cmd(*overrides: str) -> list[str]:
    return [sys.executable, "-m", "mcore_rl.train", *FAST, *overrides]


def run(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=REPO)
    return proc


def records(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    p = run_dir / name
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.is_file() else []


BAD_CONFIGS = [
    ("algorithm.name=nope", "nope"),
    ("trainer.steps=-1", "trainer.steps=-1 must be >= 0"),
    ("parallel.tp=3", "parallel.tp=3 does not divide num_attention_heads=4"),
    ("data.answer_field=solution", "solution"),
    ("data.answer=5", "data.answer=5: needs ops=['+'] and 0 <= min_operand <= max_operand <= answer"),
]


@pytest.fixture(scope="module")
def batch(tmp_path_factory) -> dict:
    """The two-step run and the bad configurations, in one interpreter (tests/train_batch.py: one start-up for
    the six). name -> (run folder, result)."""
    root = tmp_path_factory.mktemp("train_tiny")
    data = root / "train.jsonl"
    data.write_text('{"question": "What is 1 + 1?", "answer": "2"}\n' * 4)
    runs = {"two_steps": [*FAST, "trainer.steps=2", f"run.dir={root / 'two_steps'}"]}
    for i, (override, _) in enumerate(BAD_CONFIGS):
        extra = ["data=jsonl", f"data.path={data}"] if override.startswith("data.answer_") else []
        runs[override] = [*FAST, *extra, override, f"run.dir={root / f'bad{i}'}"]
    results = run_train_batch(list(runs.values()), root)
    return {name: (Path(args[-1].split("=", 1)[1]), res) for (name, args), res in zip(runs.items(), results)}


def test_tiny_two_steps_single_process(batch):
    tmp_path, proc = batch["two_steps"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.seconds < 120, f"took {proc.seconds:.0f}s"
    recs = records(tmp_path)
    assert [r["step"] for r in recs] == [1, 2]
    for key in ("reward_mean", "accuracy", "response_len", "truncation_rate", "loss", "grad_norm",
                "time_generate", "time_reward", "time_train", "time_sync", "entropy"):
        assert key in recs[-1], key
    assert_trains(recs)
    assert (tmp_path / "checkpoints" / "latest").is_file()
    assert (tmp_path / "hf" / "config.json").is_file()
    assert records(tmp_path, "eval.jsonl")  # held-out eval ran
    assert (tmp_path / "curves.png").stat().st_size > 1000
    assert list((tmp_path / "tensorboard").glob("events.*"))


@pytest.mark.multiproc
def test_tiny_two_steps_torchrun_tp2(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "mcore_rl.train", *FAST, "trainer.steps=2", "parallel=tp2", f"run.dir={tmp_path}"]
    proc = run(cmd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = records(tmp_path)
    assert [r["step"] for r in recs] == [1, 2] and all("loss" in r for r in recs)
    assert_trains(recs)


def test_resume_after_sigkill_matches_uninterrupted(tmp_path):
    common = ["trainer.steps=4", "trainer.save_every=2", "algorithm.updates_per_rollout=1", "eval.every=0",
              "algorithm.entropy_coef=0.01", "optim.lr=1e-3"]
    ref_dir, kill_dir = tmp_path / "ref", tmp_path / "killed"
    proc = run(train_cmd(*common, f"run.dir={ref_dir}"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    ref = {r["step"]: r for r in records(ref_dir)}
    # second run: SIGKILL as soon as the step-2 checkpoint is complete
    p = subprocess.Popen(train_cmd(*common, f"run.dir={kill_dir}"), env=_env(), cwd=REPO,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    latest = kill_dir / "checkpoints" / "latest"
    deadline = time.time() + 240
    while time.time() < deadline and not latest.is_file() and p.poll() is None:
        time.sleep(0.2)
    assert latest.is_file(), "no checkpoint appeared"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL
    proc = run(train_cmd(*common, f"run.dir={kill_dir}"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed = {}
    for r in records(kill_dir):
        resumed[r["step"]] = r  # the resumed run's records come last
    for step in (3, 4):
        assert abs(resumed[step]["loss"] - ref[step]["loss"]) <= 1e-6, (step, resumed[step]["loss"], ref[step]["loss"])
        assert resumed[step]["reward_mean"] == ref[step]["reward_mean"]
    assert ref[3]["loss"] != ref[4]["loss"]
    assert_trains(list(ref.values()))


def test_multirun_all_algorithms(tmp_path):
    proc = run([sys.executable, "-m", "mcore_rl.train", "-m", "algorithm=grpo,mu_grpo,p3o,ppo_ewma,scalerl",
                *FAST, "trainer.steps=2", "eval.num_prompts=0", f"hydra.sweep.dir={tmp_path}"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    jobs = sorted(p.parent for p in tmp_path.glob("*/metrics.jsonl"))
    assert len(jobs) == 5, jobs
    for job in jobs:
        recs = records(job)
        assert recs and recs[-1]["step"] == 2 and "loss" in recs[-1], job
        assert_trains(recs)


@pytest.mark.parametrize("override,needle", BAD_CONFIGS)
def test_bad_config_one_clear_line(batch, override, needle):
    _, proc = batch[override]
    assert proc.returncode != 0
    assert needle in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.seconds < 60
