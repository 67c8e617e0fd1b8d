"""Shared helpers of the fault suite: run the real trainer (`python -m mcore_rl.train model=tiny`) with fault hooks
set through the environment, read its metrics, and read checkpoint tensors without a process group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.conftest import REPO

# Random tiny model; the entropy bonus and a large lr make every update change the weights measurably.
TINY = ["model=tiny", "eval.num_prompts=0", "trainer.prompts_per_update=2", "trainer.samples_per_prompt=2",
        "trainer.max_new_tokens=8", "logging.progress=false", "logging.plot=false", "algorithm.updates_per_rollout=1",
        "algorithm.entropy_coef=0.01", "optim.lr=1e-3"]


def env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MCORE_RL_")}
    return {**base, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1", **extra}


def train_cmd(*overrides: str, nproc: int = 1) -> list[str]:
    launch = [sys.executable, "-m", "mcore_rl.train"]
    if nproc > 1:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                  "-m", "mcore_rl.train"]
    return [*launch, *TINY, *overrides]


def train(*overrides: str, timeout: int = 300, nproc: int = 1, **env_extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(train_cmd(*overrides, nproc=nproc), capture_output=True, text=True, timeout=timeout,
                          env=env(**env_extra), cwd=REPO)


def records(run_dir: Path) -> dict[int, dict]:
    """Step -> record; a resumed run's records come later in the file and win."""
    p = run_dir / "metrics.jsonl"
    out: dict[int, dict] = {}
    for line in p.read_text().splitlines() if p.is_file() else []:
        if line.strip():
            r = json.loads(line)
            out[r["step"]] = r
    return out


def _flat(d: dict, pre: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{pre}{k}."))
        elif torch.is_tensor(v):
            out[pre + k] = v
    return out


def checkpoint_tensors(step_dir: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every tensor (weights and optimizer state) of a torch_dist checkpoint, read in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir), str(out))
    return _flat(torch.load(out, weights_only=True))
