"""What the evaluation tests share: a real finished tiny run (one training update: ~20-30 s), the CLIs run as a
subprocess (`run_module`) or in this process (`eval_inproc`, `scaling_inproc`: a subprocess costs ~10 s of
imports), and a JSONL reader."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import REPO


def run_module(module: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m module args` from the repo root, one thread, no hub access; output captured."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _inproc(capsys, main: Callable[[list[str]], int]) -> Callable[..., subprocess.CompletedProcess]:
    """A CLI's main(argv) in this process, answered like subprocess.run: (args, rc, stdout, stderr)."""

    def call(*args: str) -> subprocess.CompletedProcess:
        rc = main(list(args))
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, rc, out.out, out.err)

    return call


@pytest.fixture
def eval_inproc(capsys):
    """`mcore-rl-eval` (mcore_rl.evaluation.cli) in this process."""
    from mcore_rl.evaluation.cli import main

    return _inproc(capsys, main)


@pytest.fixture
def scaling_inproc(capsys):
    """`mcore-rl-scaling` (mcore_rl.evaluation.scaling_cli) in this process."""
    from mcore_rl.evaluation.scaling_cli import main

    return _inproc(capsys, main)


@pytest.fixture(scope="session")
def tiny_run_proc(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """Two real training updates of the tiny model: config.yaml, eval.jsonl (3 evals), hf/, checkpoints/."""
    run_dir = tmp_path_factory.mktemp("tiny_run")
    proc = run_module("mcore_rl.train", "model=tiny", "eval.num_prompts=2", "eval.samples_per_prompt=2",
                      "eval.every=1", "trainer.prompts_per_update=2", "trainer.samples_per_prompt=2",
                      "trainer.max_new_tokens=8", "logging.progress=false", "logging.plot=false", "trainer.steps=2",
                      "trainer.save_every=0", f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir, proc


@pytest.fixture(scope="session")
def tiny_run(tiny_run_proc) -> Path:
    return tiny_run_proc[0]
