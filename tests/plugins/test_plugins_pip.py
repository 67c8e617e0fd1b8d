"""The plugin package pip-installed (`pip install -e`) into a virtual environment instead of put on PYTHONPATH, its
yaml found as package data (`hydra.searchpath=[pkg://guesspkg.conf]`). Slow: the import path is the one
test_plugins_cli.py covers through PYTHONPATH, and pip builds the package in an isolated environment (it fetches
setuptools from the index)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.plugins.package import write_package

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

PYPROJECT = """[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "guesspkg"
version = "0.1"

[tool.setuptools]
packages = ["guesspkg"]
"""


def test_pip_installed_plugin_package(tmp_path):
    project = tmp_path / "guesspkg_project"
    write_package(project)
    (project / "pyproject.toml").write_text(PYPROJECT)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    pip = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "-e", str(project)],
                         capture_output=True, text=True, timeout=600)
    if pip.returncode != 0:
        pytest.skip(f"pip install -e failed (no package index?): {pip.stderr[-500:]}")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MCORE_RL_PLUGINS")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    # a misspelled name fails at start-up: the listing shows the installed plugin's environment
    proc = subprocess.run([python, "-m", "mcore_rl.train", "model=tiny", "plugins=[guesspkg.envs]", "env=guess",
                           "hydra.searchpath=[pkg://guesspkg.conf]", "env.name=gess"], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == ("config error: env='gess': expected one of calculator, retry; "
                                                    "from plugins: guess (guesspkg.envs)")
