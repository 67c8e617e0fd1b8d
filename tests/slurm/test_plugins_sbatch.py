"""A user's plugin package (tests/plugins/package.py, outside the repository) on the local Slurm cluster: through
`sbatch slurm/train.sbatch` (the plugin list in the overrides, PYTHONPATH through sbatch's environment, the plugin
algorithm's schema stored on the node before Hydra composes) and through a Hydra multirun as a Slurm job
(hydra/launcher=slurm: the job composes its config on the node)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.plugins.package import markers, plugin_env, write_package

from .conftest import REPO, LocalSlurm, outcome

pytestmark = pytest.mark.slurm

PLUGIN_RUN = ["model=tiny_sevens", "trainer.prompts_per_update=4", "trainer.samples_per_prompt=4",
              "trainer.max_new_tokens=16", "eval.num_prompts=0", "trainer.export_hf=false", "logging.progress=false",
              "logging.plot=false", "logging.tensorboard=false", "trainer.steps=2", "env=guess",
              "plugins=[guesspkg.envs,guesspkg.algos]", "algorithm=grpo_plugin", "algorithm.greeting=slurm"]  # fmt: skip


def _read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.fixture
def user(tmp_path) -> dict[str, Path]:
    conf = write_package(tmp_path / "user_code")
    (tmp_path / "markers").mkdir()
    env = plugin_env(tmp_path / "user_code", tmp_path / "markers")
    return {"conf": conf, "markers": tmp_path / "markers", "env": env}


def _check_run(run_dir: Path, user: dict) -> None:
    recs = _read(run_dir / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2] and max(r["grad_norm"] for r in recs) > 0
    assert "greeting: slurm" in (run_dir / "config.yaml").read_text()
    assert markers(user["markers"], "guesspkg.envs") and markers(user["markers"], "guesspkg.algos")


def test_train_sbatch_with_a_plugin(slurm: LocalSlurm, tmp_path, user):
    job = slurm.sbatch(tmp_path, *PLUGIN_RUN, f"hydra.searchpath=[file://{user['conf']}]", env=user["env"])
    info = slurm.wait(job, timeout=400)
    assert outcome(info) == ("COMPLETED", "0:0", "0"), slurm.log(info)
    _check_run(tmp_path / "runs" / f"mcore-rl-{job}", user)
    assert list(markers(user["markers"], "guesspkg.envs").values()) == ["0"]  # the torchrun rank on the node
    assert "plugins: guesspkg.envs (env: guess), guesspkg.algos (algorithm.name: grpo_plugin)" in slurm.log(info)


def test_hydra_slurm_launcher_with_a_plugin(slurm: LocalSlurm, tmp_path, user):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install hydra-submitit-launcher")
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "mcore_rl.train", "-m", "hydra/launcher=slurm", f"hydra.sweep.dir={sweep}",
           "hydra.sweep.subdir=${hydra.job.num}",
           f"hydra.searchpath=[file://{REPO}/hydra_conf,file://{user['conf']}]", *PLUGIN_RUN]
    env = {**slurm.env, **user["env"]}
    env.pop("MCORE_RL_PLUGINS", None)
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = [p.parent for p in sweep.glob("*/metrics.jsonl")]
    _check_run(run_dir, user)
    assert len(markers(user["markers"], "guesspkg.algos")) >= 2  # the submitting process and the job's
