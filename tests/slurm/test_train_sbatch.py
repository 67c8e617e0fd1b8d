"""slurm/train.sbatch on a real local Slurm: usage errors, multi-node torchrun, SGLang nodes, real trainer."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from .conftest import LOCAL_CLUSTER, REAL_FAST, TRAIN_SBATCH, LocalSlurm, outcome

pytestmark = pytest.mark.slurm

def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_script(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SGLANG_"))}
    return subprocess.run(["bash", str(TRAIN_SBATCH), *args], env={**clean, **env}, capture_output=True,
                          text=True, timeout=30)


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--help"], {}, "usage: sbatch"),
        (["-N2"], {}, "unknown option '-N2'"),
        (["trainer.steps=2"], {}, "not running under Slurm"),
        (["model=tiny", "trainer.steps"], {"SLURM_JOB_ID": "7"}, "'trainer.steps' is not a Hydra override"),
        (["model=tiny"], {"SLURM_JOB_ID": "7", "SGLANG_NODES": "two"}, "SGLANG_NODES='two' is not"),
        (["model=tiny"], {"SLURM_JOB_ID": "7", "SGLANG_ROUTER": "yes"}, "SGLANG_ROUTER='yes' must be 0 or 1"),
        (["model=tiny"], {"SLURM_JOB_ID": "7", "MCORE_RL_MAX_REQUEUES": "-1"}, "MCORE_RL_MAX_REQUEUES='-1' is not"),
        (["model=tiny"], {"SLURM_JOB_ID": "7", "MCORE_RL_STOP_LEAD_S": "5m"}, "MCORE_RL_STOP_LEAD_S='5m' is not"),
    ],
)
def test_usage_errors_exit_2_without_traceback(args, env, message):
    proc = run_script(*args, **env)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "usage:" in proc.stderr or "error:" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_local_cluster_usage_errors():
    bad = subprocess.run(["bash", str(LOCAL_CLUSTER), "start"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "usage:" in bad.stderr
    nodes = subprocess.run(["bash", str(LOCAL_CLUSTER), "status"], capture_output=True, text=True, timeout=30,
                           env={**os.environ, "MCORE_RL_SLURM_NODES": "0"})
    assert nodes.returncode == 1 and "MCORE_RL_SLURM_NODES='0'" in nodes.stderr


def test_bad_layout_fails_job_with_exit_2(slurm: LocalSlurm, tmp_path):
    """Errors only Slurm can reveal (node counts) end the job with exit 2 and a readable message."""
    job = slurm.sbatch(tmp_path, "model=tiny", env={"SGLANG_NODES": "1", "SGLANG_MODEL": "m"})
    info = slurm.wait(job, timeout=60)
    assert outcome(info)[:2] == ("FAILED", "2:0")
    log = slurm.log(info)
    assert "SGLANG_NODES=1 leaves no trainer node in a 1-node job" in log and "Traceback" not in log


def tiny_run_dir(tmp_path: Path, job: str) -> Path:
    return tmp_path / "runs" / f"mcore-rl-{job}"


def test_real_trainer_completes(slurm: LocalSlurm, tmp_path):
    job = slurm.sbatch(tmp_path, *REAL_FAST, "trainer.steps=2")
    info = slurm.wait(job, timeout=300)
    assert outcome(info) == ("COMPLETED", "0:0", "0"), slurm.log(info)
    run_dir = tiny_run_dir(tmp_path, job)
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert not (run_dir / "PREEMPTED").exists()
    assert (run_dir / "logs" / "job.out").resolve() == tmp_path / f"mcore-rl-{job}.out"


@pytest.mark.slow
def test_two_nodes_real_trainer_dp2(slurm: LocalSlurm, tmp_path):
    """2 nodes x 1 process: c10d rendezvous across nodes, the real trainer with DP=2, metrics and checkpoint."""
    job = slurm.sbatch(tmp_path, *REAL_FAST, "trainer.steps=2", nodes=2)
    info = slurm.wait(job, timeout=600)
    assert outcome(info) == ("COMPLETED", "0:0", "0"), slurm.log(info)
    run_dir = tiny_run_dir(tmp_path, job)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["loss"] == m["loss"] for m in metrics)  # finite, not NaN
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    assert ckpt.name == "step_000002" and ckpt.is_dir()
    log = slurm.log(info)
    assert "trainer on node1 node2 (1 proc/node)" in log and "trainer exited with 0" in log
    config = (run_dir / "config.yaml").read_text()
    assert "tp: 1" in config and "pp: 1" in config  # so the world of 2 is data parallel
