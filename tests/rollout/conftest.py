"""Rollout fixtures: two tiny random Llama folders (for weight-update tests), a loopback mcore-rl-serve."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.conftest import save_random_hf, tiny_llama_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def rollout_config():
    return tiny_llama_config(
        num_hidden_layers=2, vocab_size=256, max_position_embeddings=512, eos_token_id=2, bos_token_id=1,
        pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return save_random_hf(tmp_path_factory.mktemp("rollout_tiny"), rollout_config(), seed=0)


@pytest.fixture(scope="session")
def tiny_alt_dir(tmp_path_factory) -> Path:
    """Same architecture, different weights: what a weight update should switch to."""
    return save_random_hf(tmp_path_factory.mktemp("rollout_tiny_alt"), rollout_config(), seed=1)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_alt_model(tiny_alt_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_alt_dir, dtype=torch.float32).eval()


def forward_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """The trainer's convention: log_softmax(logits / T) of the produced tokens, one plain unpadded forward."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
    return logp[len(prompt) - 1 : -1].gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)


@pytest.fixture(scope="session")
def served(tiny_dir, tmp_path_factory):
    """Two real `mcore-rl-serve` subprocesses on free loopback ports, under the launcher."""
    from mcore_rl.rollout.sglang.launcher import ServerLauncher

    with ServerLauncher(two_serve_workers(tiny_dir, tmp_path_factory.mktemp("serve_logs"))) as launcher:
        yield launcher


def two_serve_workers(model_dir: Path, log_dir: Path):
    """Launcher settings for two single-threaded `mcore-rl-serve` workers on free loopback ports."""
    from mcore_rl.rollout.sglang.launcher import MCORE_RL_SERVE_COMMAND, LauncherConfig

    return LauncherConfig(
        model_path=str(model_dir), num_servers=2, command=MCORE_RL_SERVE_COMMAND + ["--num-threads", "1"],
        log_dir=str(log_dir), health_timeout_s=120, monitor_interval_s=0.5,
    )  # fmt: skip
