"""`trainer.dist_timeout_s` through the CLI: the value reaches every process group the trainer creates (read back
from the groups themselves and logged at start-up), and a non-positive value is a one-line config error (exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from tests.distributed.test_collective_layer import REPO

pytestmark = pytest.mark.e2e

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1",
       "PYTHONPATH": str(REPO)}


def _train(*overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mcore_rl.train", "model=tiny", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV, cwd=REPO)


def test_timeout_reaches_every_group(tmp_path):  # ~30 s: one 0-step run of the tiny model
    run_dir = tmp_path / "run"
    proc = _train("trainer.dist_timeout_s=2400", "trainer.steps=0", "eval.num_prompts=0", "trainer.export_hf=false",
                  "logging.progress=false", "logging.plot=false", "logging.tensorboard=false",
                  "model.load_check.enabled=false", f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stderr.splitlines() if "process groups:" in x)
    assert "timeout_s=2400 (default group), 2400 (host group), 2400 (data parallel)" in line, line
    assert OmegaConf.load(run_dir / "config.yaml").trainer.dist_timeout_s == 2400


def test_non_positive_timeout_is_a_config_error(tmp_path):
    proc = _train("trainer.dist_timeout_s=0", f"run.dir={tmp_path}")
    assert proc.returncode == 2
    # torch's own import-time warnings (e.g. "No CUDA runtime is found" from a CUDA wheel) may precede it
    errors = [x for x in proc.stderr.splitlines() if x.startswith("config error:")]
    assert errors == ["config error: trainer.dist_timeout_s=0.0 must be > 0"], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
