"""A real finished tiny run, shared by the evaluation tests (one training update: ~20-30 s)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="session")
def tiny_run_proc(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """Two real training updates of the tiny model: config.yaml, eval.jsonl (3 evals), hf/, checkpoints/."""
    run_dir = tmp_path_factory.mktemp("tiny_run")
    cmd = [sys.executable, "-m", "mcore_rl.train", "model=tiny", "eval.num_prompts=2", "eval.samples_per_prompt=2",
           "eval.every=1", "trainer.prompts_per_update=2", "trainer.samples_per_prompt=2",
           "trainer.max_new_tokens=8", "logging.progress=false", "logging.plot=false", "trainer.steps=2",
           "trainer.save_every=0", f"run.dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir, proc


@pytest.fixture(scope="session")
def tiny_run(tiny_run_proc) -> Path:
    return tiny_run_proc[0]
