"""Defaults a GPU user meets first: SGLang missing, determinism, the embedded engine's device, the micro-batch size."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from mcore_rl.config.trainer import resolve_deterministic
from mcore_rl.rollout.sglang.launcher import LauncherConfig, ServerLauncher
from mcore_rl.rollout.sglang.preflight import engine_determinism, missing_server
from tests.config.keyscan import REPO, compose

MISSING = (
    "rollout=sglang needs SGLang on this machine: pip install 'mcore-rl[gpu]' "
    "(or set rollout.worker_urls to running servers)"
)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_rollout_sglang_without_sglang_is_one_line_exit_2(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mcore_rl.train",
            "model=tiny",
            "rollout=sglang",
            "rollout.launcher.server=sglang",
            f"run.dir={tmp_path}/run",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == f"config error: {MISSING}"
    assert "Traceback" not in proc.stderr


def test_missing_server_only_where_servers_are_launched(monkeypatch):
    from mcore_rl.rollout.sglang import preflight

    monkeypatch.setattr(preflight, "_installed", lambda module: module == "sglang_router")
    rc = OmegaConf.to_container(compose(["model=tiny", "rollout=sglang"]).rollout)
    assert missing_server(rc) == MISSING
    assert missing_server({**rc, "worker_urls": ["http://node1:30000"]}) is None  # servers run elsewhere
    assert missing_server({**rc, "launcher": {**rc["launcher"], "server": "mcore-rl-serve"}}) is None
    assert missing_server(OmegaConf.to_container(compose(["model=tiny", "rollout=local"]).rollout)) is None
    monkeypatch.setattr(preflight, "_installed", lambda module: module == "sglang")
    assert "needs sglang-router" in missing_server({**rc, "launcher": {**rc["launcher"], "router": True}})


def _server_flags(overrides: list[str]) -> list[str]:
    """What the trainer does with the composed config: rollout options -> engine_determinism -> launch cmd."""
    cfg = compose(["model=tiny", "rollout=sglang", *overrides])
    deterministic = resolve_deterministic(cfg.trainer.deterministic, cfg.rollout.engine)
    rc = engine_determinism(OmegaConf.to_container(cfg.rollout), deterministic)
    launch = {k: v for k, v in rc["launcher"].items() if k != "log_dir"}
    cmd = (
        ServerLauncher(LauncherConfig(model_path="/m", deterministic=rc["deterministic"], **launch))
        .plan()[0]
        .cmd
    )
    return [tok for tok in cmd if tok.startswith("--enable")]


def test_deterministic_inference_only_where_the_run_asks_for_it():
    assert compose(["model=tiny", "rollout=sglang"]).rollout.deterministic is False  # the yaml default
    assert compose(["model=tiny"]).trainer.deterministic is None  # null: decided by the engine
    assert _server_flags([]) == []  # a default SGLang run gets the fast kernels
    assert resolve_deterministic(None, "local") is True  # the embedded engine is reproducible for free
    assert _server_flags(["trainer.deterministic=false"]) == []
    assert _server_flags(["trainer.deterministic=true"]) == ["--enable-deterministic-inference"]
    assert _server_flags(["trainer.deterministic=false", "rollout.deterministic=true"]) == [
        "--enable-deterministic-inference"
    ]


def test_embedded_engine_runs_on_the_trainers_device(monkeypatch, tiny_llama_dir):
    import torch

    from mcore_rl.config import ConfigError
    from mcore_rl.rollout.local.engine import LocalEngine, resolve_device

    assert compose(["model=tiny", "rollout=local"]).rollout.device == "auto"
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda", 3)
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    eng = LocalEngine(str(tiny_llama_dir), device="auto", max_batch_size=1)
    try:
        assert eng.device == torch.device("cpu") and next(eng.model.parameters()).device.type == "cpu"
    finally:
        eng.close()
    from mcore_rl.config import validate

    bad = compose(["model=tiny", "rollout=local", "rollout.device=gpu0"])
    with pytest.raises(ConfigError, match=r"rollout.device='gpu0': expected auto, cpu, cuda or cuda:N"):
        validate(bad)


def test_a_small_token_budget_on_cuda_is_one_warning(caplog):
    """trainer.token_budget=512 sizes CPU micro-batches; on CUDA the run says at start what to set instead."""
    from mcore_rl.config import load_config
    from mcore_rl.trainer.setup import warn_small_gpu_budget

    budget = load_config(compose(["model=tiny"])).trainer.token_budget
    with caplog.at_level("WARNING"):
        msg = warn_small_gpu_budget(budget, cuda=True)
    assert msg and "trainer.token_budget=512 on CUDA" in msg and "trainer.token_budget=8192-16384" in msg
    assert msg in caplog.text
    assert warn_small_gpu_budget(budget, cuda=False) is None  # the CPU main job's size: nothing to say
    assert warn_small_gpu_budget(16384, cuda=True) is None
