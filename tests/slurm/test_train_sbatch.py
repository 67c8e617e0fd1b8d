"""slurm/train.sbatch on a real local Slurm: usage errors, multi-node torchrun, SGLang nodes, real trainer."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from .conftest import (
    FAKE_SGLANG,
    FAKE_TRAINER,
    LOCAL_CLUSTER,
    REAL_FAST,
    TRAIN_SBATCH,
    LocalSlurm,
    free_port,
    outcome,
)

pytestmark = pytest.mark.slurm

HAVE_TRAINER = importlib.util.find_spec("mcore_rl.train") is not None


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


def test_two_nodes_torchrun_completes(slurm: LocalSlurm, tmp_path):
    """2 nodes x 1 process: c10d rendezvous across nodes, one gloo all-reduce, metrics and checkpoint."""
    env = {"MCORE_RL_TRAIN_CMD": str(FAKE_TRAINER)}
    job = slurm.sbatch(tmp_path, "trainer.steps=3", "fake.dist=true", env=env, nodes=2)
    info = slurm.wait(job, timeout=120)
    assert outcome(info) == ("COMPLETED", "0:0", "0"), slurm.log(info)
    run_dir = tmp_path / "runs" / f"mcore-rl-{job}"
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_3"
    ranks = sorted(read_jsonl(run_dir / "ranks.jsonl"), key=lambda r: r["rank"])
    assert [(r["rank"], r["world"], r["node"]) for r in ranks] == [(0, 2, "node1"), (1, 2, "node2")]
    assert [r["all_reduce"] for r in ranks] == [3.0, 3.0]  # 1 + 2 summed over both nodes
    assert f"run.dir={run_dir}" in ranks[0]["argv"] and f"hydra.run.dir={run_dir}" in ranks[0]["argv"]
    assert not (run_dir / "PREEMPTED").exists()
    assert (run_dir / "logs" / "job.out").resolve() == tmp_path / f"mcore-rl-{job}.out"


def test_sglang_nodes_and_router(slurm: LocalSlurm, tmp_path):
    """The last node serves (fake) SGLang; the script waits for /health and passes the router URL on."""
    port, router_port = free_port(), free_port()
    env = {
        "MCORE_RL_TRAIN_CMD": str(FAKE_TRAINER),
        "SGLANG_NODES": "1", "SGLANG_MODEL": "/models/m", "SGLANG_ARGS": "--tp 1", "SGLANG_ROUTER": "1",
        "SGLANG_PORT": str(port), "SGLANG_ROUTER_PORT": str(router_port),
        "SGLANG_CMD": f"python {FAKE_SGLANG} --fake-delay 2", "SGLANG_ROUTER_CMD": f"python {FAKE_SGLANG}",
    }
    job = slurm.sbatch(tmp_path, "trainer.steps=1", env=env, nodes=2)
    info = slurm.wait(job, timeout=120)
    assert outcome(info)[:2] == ("COMPLETED", "0:0"), slurm.log(info)
    run_dir = tmp_path / "runs" / f"mcore-rl-{job}"
    server = json.loads((run_dir / f"fake_sglang-{port}.json").read_text())
    router = json.loads((run_dir / f"fake_sglang-{router_port}.json").read_text())
    worker_url, router_url = f"http://127.0.0.2:{port}", f"http://127.0.0.1:{router_port}"
    assert server["node"] == "node2" and server["argv"] == ["--model-path", "/models/m", "--tp", "1"]
    assert router["argv"] == ["--worker-urls", worker_url]
    (seen,) = read_jsonl(run_dir / "ranks.jsonl")
    assert seen["node"] == "node1"
    assert seen["sglang_urls"] == [router_url] and seen["health"] == {router_url: 200}
    assert (seen["env_router"], seen["env_workers"]) == (router_url, worker_url)


@pytest.mark.skipif(not HAVE_TRAINER, reason="mcore_rl.train is not importable yet (the real entry point)")
def test_real_trainer_completes(slurm: LocalSlurm, tmp_path):
    job = slurm.sbatch(tmp_path, *REAL_FAST, "trainer.steps=2")
    info = slurm.wait(job, timeout=300)
    assert outcome(info)[:2] == ("COMPLETED", "0:0"), slurm.log(info)
    run_dir = tmp_path / "runs" / f"mcore-rl-{job}"
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")][-1] == 2
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest and (run_dir / "checkpoints" / latest).exists()
    assert not (run_dir / "PREEMPTED").exists()
