"""Hydra multirun through hydra/launcher=slurm (our config over submitit_slurm) on the local cluster."""

from __future__ import annotations

import importlib.util
import json
import pickle
import subprocess
import sys

import pytest

from .conftest import REAL_FAST, REPO, LocalSlurm

pytestmark = pytest.mark.slurm

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install hydra-submitit-launcher")


def multirun(slurm: LocalSlurm, app: list[str], sweep_dir, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *app, "-m", f"hydra.searchpath=[file://{REPO}/hydra_conf]", "hydra/launcher=slurm",
           f"hydra.sweep.dir={sweep_dir}", *overrides]
    proc = subprocess.run(cmd, env=slurm.env, cwd=sweep_dir.parent, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_two_job_sweep_runs_as_slurm_array(slurm: LocalSlurm, tmp_path):
    sweep = tmp_path / "sweep"
    multirun(slurm, [str(REPO / "tests" / "slurm" / "hydra_app.py")], sweep, "x=3,5")
    results = sorted((json.loads(p.read_text()) for p in sweep.glob("*/result.json")), key=lambda r: r["x"])
    assert [r["x"] for r in results] == [3, 5]
    assert len({r["array_job_id"] for r in results}) == 1 and None not in {r["array_job_id"] for r in results}
    assert sorted(r["array_task_id"] for r in results) == ["0", "1"]
    assert {r["mem_gb"] for r in results} == {4}  # our slurm.yaml, not the plugin's default (null)
    # submitit's pickled results: the task function's return value for each sweep point
    returns = []
    for pkl in sorted(sweep.glob(".submitit/*_*/*_result.pkl")):
        status, job_return = pickle.loads(pkl.read_bytes())
        assert status == "success"
        returns.append(job_return.return_value)
    assert sorted(returns) == [6, 10]


@pytest.mark.skipif(importlib.util.find_spec("mcore_rl.train") is None,
                    reason="mcore_rl.train is not importable yet (the real entry point)")
def test_real_trainer_sweep(slurm: LocalSlurm, tmp_path):
    sweep = tmp_path / "sweep"
    multirun(slurm, ["-m", "mcore_rl.train"], sweep, *REAL_FAST, "trainer.steps=2", "seed=1,2")
    metrics = sorted(sweep.glob("*/metrics.jsonl"))
    assert len(metrics) == 2
    for path in metrics:
        steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]
        assert steps[-1] == 2
