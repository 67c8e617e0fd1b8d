"""The package works from a wheel, not only from an editable checkout: configs ship as package data.

Builds the wheel, installs it into a fresh venv (reusing this interpreter's torch/megatron through a .pth
line, no network), and runs `mcore-rl-train model=... trainer.steps=2` from an unrelated
directory without PYTHONPATH, with the model config coming from the user's own folder via Hydra's search path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e

FAST = ["eval.num_prompts=2", "eval.samples_per_prompt=2", "eval.max_new_tokens=8", "trainer.prompts_per_update=2",
        "trainer.samples_per_prompt=2", "trainer.max_new_tokens=8", "logging.progress=false", "logging.plot=false",
        "trainer.export_hf=false"]


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return proc


def test_wheel_install_trains_from_another_directory(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    t0 = time.monotonic()
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
          str(tmp_path / "dist"), str(REPO)], env, tmp_path)
    (wheel,) = (tmp_path / "dist").glob("mcore_rl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {n.removeprefix("mcore_rl/hydra_conf/") for n in names if n.startswith("mcore_rl/hydra_conf/")}
    in_repo = {str(p.relative_to(REPO / "hydra_conf")) for p in (REPO / "hydra_conf").rglob("*.yaml")}
    assert in_repo and in_repo <= shipped, sorted(in_repo - shipped)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], env, tmp_path)
    # reuse this interpreter's torch/megatron (no download): its site-packages go on the venv's path after the
    # venv's own, and without processing their .pth files (so no editable mcore_rl finder from a checkout)
    (site,) = (venv / "lib").glob("python3.*/site-packages")
    outer = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    (site / "_outer_env.pth").write_text("".join(f"{p}\n" for p in sorted(outer)))
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], env, tmp_path)
    where = _run([str(venv / "bin" / "python"), "-c", "import mcore_rl; print(mcore_rl.__file__)"], env, tmp_path)
    assert where.stdout.strip().startswith(str(venv)), where.stdout  # the wheel, not the checkout

    # the user's own config folder, found through Hydra's search path: a 1-layer variant of model=tiny
    user_conf = tmp_path / "my_configs" / "model"
    user_conf.mkdir(parents=True)
    (user_conf / "tiny_1layer.yaml").write_text("defaults:\n  - tiny\n  - _self_\ntiny:\n  num_hidden_layers: 1\n")
    elsewhere, run_dir = tmp_path / "elsewhere", tmp_path / "run"
    elsewhere.mkdir()
    proc = _run([str(venv / "bin" / "mcore-rl-train"), f"hydra.searchpath=[file://{tmp_path / 'my_configs'}]",
                 "model=tiny_1layer", "trainer.steps=2", *FAST, f"run.dir={run_dir}"], env, elsewhere, timeout=400)
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert steps == [1, 2], proc.stderr[-2000:]
    assert "num_hidden_layers: 1" in (run_dir / "config.yaml").read_text()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000002"
    print(f"wheel build + venv + 2-update run: {time.monotonic() - t0:.0f}s")
