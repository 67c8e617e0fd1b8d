"""Shared fixtures: tiny random HF models, torchrun launcher, the real SmolLM2 folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
# Modules that must share one xdist worker: the session-scoped local Slurm cluster serves every tests/slurm file.
SHARED_WORKER_DIRS = {"slurm": REPO / "tests" / "slurm"}


def xdist_workers() -> int:
    """How many pytest-xdist workers this session runs (0: not under xdist)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)


def _split_cores_among_workers() -> None:
    """Under pytest-xdist, N workers share the cores: each gets cores / N intra-op threads (and so do the children
    it starts without their own setting), since N x all-cores OpenMP pools spin against each other."""
    workers = xdist_workers()
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))


_split_cores_among_workers()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`--dist loadgroup` (scripts/test.sh): one group per test module, so module fixtures (a batch of CLI runs
    several tests read) run once, and one group for modules that share a session fixture that cannot be started
    twice. Runs before xdist's own hook, which turns the marks into the groups."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        group = next((name for name, d in SHARED_WORKER_DIRS.items() if d in item.path.parents),
                     item.path.relative_to(REPO).as_posix())
        item.add_marker(pytest.mark.xdist_group(group))


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=256,
              rms_norm_eps=1e-5)
    kw.update(overrides)
    return LlamaConfig(**kw)


def save_random_hf(folder: Path, config, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # random init gives tiny logits; widen them so log-prob checks are not trivially near-uniform
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_random_hf(tmp_path_factory.mktemp("tiny_llama"), tiny_llama_config())


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from mcore_rl.models.smollm2 import materialize_smollm2

    try:
        return materialize_smollm2()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@dataclass(frozen=True)
class TrainResult:
    """One command line's outcome from `run_train_batch` (what `subprocess.CompletedProcess` gives a test)."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def run_train_batch(runs: list[list[str]], scratch: Path, timeout: int = 1800) -> list[TrainResult]:
    """`mcore-rl-train ARGS` for each ARGS, in order, in one fresh interpreter (tests/train_batch.py: one
    torch/Megatron start-up and one reward forkserver for them all). Exit codes are returned, not asserted."""
    job = scratch / "train_calls.json"
    job.write_text(json.dumps([list(map(str, args)) for args in runs]))
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": pythonpath}
    proc = subprocess.run([sys.executable, "-m", "tests.train_batch", str(job)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise AssertionError(f"train batch died ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    done = json.loads(job.with_name(job.name + ".out").read_text())
    return [TrainResult(r["argv"], r["rc"], r["stdout"], r["stderr"], r["seconds"]) for r in done]


def run_torchrun(nproc: int, script: Path | str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Launch `torchrun --nproc_per_node=nproc script args` (gloo on CPU); fail with its output on error."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone",
           str(script), *args]
    # Workers may import shared helpers as `tests.<pkg>.<module>`: the repo root must be importable in them.
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": pythonpath}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc
