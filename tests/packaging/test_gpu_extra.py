"""The `[gpu]` extra pins versions that resolve together: sglang 0.5.23 and the torch / transformers its wheel
requires exactly, and the base dependencies admit them. (.ci/run runs pip's resolver over '.[gpu]' as well.)"""

from __future__ import annotations

import glob
import tomllib
import zipfile

import pytest
from packaging.requirements import Requirement

from tests.conftest import REPO

PINS = {"sglang": "0.5.23", "sglang-router": "0.3.2", "torch": "2.14.1", "transformers": "5.19.0"}


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_gpu_extra_is_pinned_and_the_base_dependencies_admit_the_pins():
    project = _project()
    gpu = {r.name: r for r in map(Requirement, project["optional-dependencies"]["gpu"])}
    assert {name: str(r.specifier) for name, r in gpu.items()} == {k: f"=={v}" for k, v in PINS.items()}
    base = {r.name: r for r in map(Requirement, project["dependencies"])}
    for name, version in PINS.items():
        if name in base:  # torch, transformers
            assert base[name].specifier.contains(version), f"{name}{base[name].specifier} excludes {version}"
    assert {"torch", "transformers"} <= set(base)


@pytest.mark.skipif(
    not glob.glob("/tmp/sgl/sglang-0.5.23-*.whl"), reason="the sglang 0.5.23 wheel is not here"
)
def test_pins_are_what_the_sglang_wheel_requires():
    wheel = glob.glob("/tmp/sgl/sglang-0.5.23-*.whl")[0]
    meta = zipfile.ZipFile(wheel).read("sglang-0.5.23.dist-info/METADATA").decode()
    reqs = [
        Requirement(line.split(":", 1)[1].strip())
        for line in meta.splitlines()
        if line.startswith("Requires-Dist:")
    ]
    core = {r.name.lower(): r for r in reqs if r.marker is None}
    for name in ("torch", "transformers"):
        assert core[name].specifier.contains(PINS[name]) and str(core[name].specifier) == f"=={PINS[name]}"


def test_ci_checks_the_gpu_install_resolves():
    ci = (REPO / ".ci" / "run").read_text()
    assert "pip install --dry-run --ignore-installed" in ci and "'.[gpu]'" in ci and "rcgpu == 0" in ci
