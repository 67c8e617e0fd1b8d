"""A private 2-node Slurm cluster (slurm/local_cluster.sh) for the whole session, plus job helpers.

Two virtual nodes on one host let the tests cover multi-node torchrun and dedicated SGLang nodes.
Skips only where Slurm/munge are not installed or we are not root (slurmd must start jobs as their owner).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOCAL_CLUSTER = REPO / "slurm" / "local_cluster.sh"
TRAIN_SBATCH = REPO / "slurm" / "train.sbatch"
FAKE_TRAINER = Path(__file__).with_name("fake_trainer.py")
# Small batches for the real trainer (`model=tiny`): integration, not learning; ~25 s instead of ~60 s.
REAL_FAST = [
    "model=tiny", "trainer.prompts_per_update=2", "trainer.samples_per_prompt=2", "trainer.max_new_tokens=8",
    "eval.num_prompts=2", "eval.samples_per_prompt=2", "eval.max_new_tokens=8", "trainer.export_hf=false",
    "logging.progress=false", "logging.plot=false",
]
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE"}
# A requeued job passes through PENDING/REQUEUED; wait for one of these when a requeue is expected.
FINAL_AFTER_REQUEUE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}


def outcome(info: dict[str, str]) -> tuple[str, str, str]:
    """(state, exit code, restarts) of a job, e.g. ("COMPLETED", "0:0", "1")."""
    return info.get("JobState", "?"), info.get("ExitCode", "?"), info.get("Restarts", "?")


def free_port(span: int = 1) -> int:
    """A port p with p..p+span-1 all free right now (good enough on a test machine)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + span >= 65535:
            continue
        try:
            for p in range(base, base + span):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range found")


def rendezvous_port() -> int:
    """A free port below the kernel's ephemeral range (32768-60999 by default). The job binds it only after Slurm
    starts it, seconds later: an ephemeral port free now can by then be the source port of any outgoing connection
    on the machine (a rendezvous then failed with EADDRINUSE in the suite), one outside that range cannot."""
    import random
    import socket

    for port in random.sample(range(20000, 32000), 200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()


@dataclass
class LocalSlurm:
    """Handle on the running test cluster; every client call goes through `env` (SLURM_CONF)."""

    folder: Path
    env: dict[str, str]

    def run(self, *cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        env = kw.pop("env", self.env)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, **kw)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr}")
        return proc

    def sbatch(self, workdir: Path, *args: str, env: dict[str, str] | None = None, nodes: int = 1,
               options: tuple[str, ...] = ()) -> str:
        """Submit train.sbatch from `workdir` (its run dirs go to workdir/runs); returns the job id."""
        job_env = {**self.env, "MCORE_RL_RDZV_PORT": str(rendezvous_port()), **(env or {})}
        proc = self.run("sbatch", "--parsable", f"--nodes={nodes}", f"--output={workdir}/%x-%j.out", *options,
                        str(TRAIN_SBATCH), *args, env=job_env, cwd=workdir)
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: str, timeout: float, until=None) -> dict[str, str]:
        """Poll until the job ends (or `until(info)` holds); on timeout fail with the job's log."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if until(info) if until else info.get("JobState") in TERMINAL:
                return info
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} still {info.get('JobState')} after {timeout}s:\n{self.log(info)}")

    def log(self, info: dict[str, str]) -> str:
        path = Path(info.get("StdOut", ""))
        return path.read_text()[-4000:] if path.is_file() else "(no job log)"

    def cancel_all(self) -> None:
        ids = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
        if ids:
            self.run("scancel", *ids, check=False)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> LocalSlurm:
    missing = [b for b in ("munged", "mungekey", "slurmctld", "slurmd", "sbatch")
               if not (shutil.which(b) or Path("/usr/sbin", b).exists())]
    if missing:
        pytest.skip(f"Slurm not installed (missing {', '.join(missing)}): apt-get install -y slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (slurmd starts jobs as their owner)")
    folder = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "MCORE_RL_SLURM_DIR": str(folder), "MCORE_RL_SLURM_PORT": str(free_port(3)),
           "MCORE_RL_SLURM_NODES": "2", "MCORE_RL_SLURM_CRED_EXPIRE": "5", "MCORE_RL_SLURM_CPUS": "2"}
    # Nothing from an outer Slurm job or the caller's own settings may leak into the test jobs.
    leaky = ("SLURM_", "SBATCH_", "SRUN_", "SGLANG_", "MCORE_RL_TRAIN", "MCORE_RL_RUN", "MCORE_RL_NPROC")
    for key in [k for k in env if k.startswith(leaky)]:
        env.pop(key)
    up = subprocess.run(["bash", str(LOCAL_CLUSTER), "up"], env=env, capture_output=True, text=True,
                        timeout=120)
    if up.returncode != 0:
        logs = "\n".join(p.read_text()[-2000:] for p in (folder / "log").glob("*.log"))
        subprocess.run(["bash", str(LOCAL_CLUSTER), "down"], env=env, capture_output=True, timeout=120)
        pytest.fail(f"local_cluster.sh up failed: {up.stderr}\n{logs}")
    env["SLURM_CONF"] = str(folder / "slurm.conf")
    cluster = LocalSlurm(folder=folder, env=env)
    yield cluster
    cluster.cancel_all()
    subprocess.run(["bash", str(LOCAL_CLUSTER), "down"], env=env, capture_output=True, timeout=120)


@pytest.fixture
def slurm(slurm_cluster: LocalSlurm) -> LocalSlurm:
    """Per test: the session cluster, with every job the test left behind cancelled afterwards."""
    yield slurm_cluster
    slurm_cluster.cancel_all()
