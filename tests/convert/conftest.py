"""Tiny random Qwen2 / Qwen3 HF models and a CLI runner for the conversion tests.

Megatron work always runs in a subprocess (the CLI), so the CPU shim and process groups never leak into pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
CLI = ["-m", "mcore_rl.convert.cli"]  # mcore-rl-convert, run from the checkout


def qwen2_config():
    """Qwen2: QKV bias, GQA (4 q heads / 2 kv heads), untied head, vocab whose TP padding differs at TP1 vs TP2."""
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=1100, tie_word_embeddings=False,
                       max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0)


def qwen3_config():
    """Qwen3: per-head q/k RMSNorm, head_dim (32) != hidden/heads (16), GQA, tied embeddings."""
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, vocab_size=512, tie_word_embeddings=True,
                       max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1000000.0)


def qwen3_moe_config(**overrides):
    """Tiny Qwen3-MoE: 4 layers, 8 experts, top-2 with normalised top-k probabilities, q/k norm, untied head."""
    from transformers import Qwen3MoeConfig

    kw = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
              norm_topk_prob=True, vocab_size=512, tie_word_embeddings=False, max_position_embeddings=256,
              rms_norm_eps=1e-6)
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def save_random_model(folder: Path, config, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """Random weights with every tensor perturbed (norms and biases too), so a mapping slip changes the logits."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # matrices, and transformers >= 5's fused expert stacks [E, out, in]
                p.mul_(3.0)
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:  # RMSNorm weights
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.to(dtype).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> Path:
    return save_random_model(tmp_path_factory.mktemp("qwen2"), qwen2_config(), seed=1)


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    return save_random_model(tmp_path_factory.mktemp("qwen3"), qwen3_config(), seed=2)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_cli(*args: str, rc: int | None = 0, timeout: int = 300) -> subprocess.CompletedProcess:
    """`mcore-rl-convert --quiet ARGS`; asserts the exit code unless rc is None."""
    proc = subprocess.run([sys.executable, *CLI, "--quiet", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=REPO)
    if rc is not None and proc.returncode != rc:
        raise AssertionError(f"exit {proc.returncode} (wanted {rc}) for {args}:\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-5000:]}")
    return proc


@dataclass(frozen=True)
class CliResult:
    """One command's outcome from `run_cli_batch` (what `subprocess.CompletedProcess` gives `run_cli`)."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


def run_cli_batch(calls: list[list], scratch: Path, timeout: int = 600) -> list[CliResult]:
    """`mcore-rl-convert --quiet ARGS` for each ARGS, in order, in one fresh interpreter (tests/convert/cli_batch.py:
    one torch/Megatron start-up for them all). Exit codes are returned, not asserted."""
    job = scratch / "calls.json"
    job.write_text(json.dumps([["--quiet", *map(str, args)] for args in calls]))
    proc = subprocess.run([sys.executable, "-m", "tests.convert.cli_batch", str(job)], capture_output=True,
                          text=True, timeout=timeout, env=_env(), cwd=REPO)
    if proc.returncode != 0:
        raise AssertionError(f"cli batch died ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    done = json.loads(job.with_name(job.name + ".out").read_text())
    return [CliResult(r["argv"], r["rc"], r["stdout"], r["stderr"]) for r in done]


def run_python(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run a snippet in a fresh interpreter (failure injection without touching this process)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env=_env(), cwd=REPO)


def max_logit_diff(proc: subprocess.CompletedProcess | CliResult) -> float:
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("max_abs_logit_diff="))
    return float(line.split()[0].split("=")[1])


def assert_same_hf_tensors(a_dir: Path, b_dir: Path, dtype: torch.dtype | None = None) -> int:
    """Every tensor of a (cast to `dtype` if given) equals b's bit for bit, same names, b in that dtype."""
    from mcore_rl.models.hf_io import HFReader

    a, b = HFReader(a_dir), HFReader(b_dir)
    assert set(a.names()) == set(b.names())
    for name in a.names():
        x, y = a.get(name), b.get(name)
        if dtype is not None:
            x = x.to(dtype)
        assert x.dtype == y.dtype, name
        assert torch.equal(x, y), name
    return len(a.names())


def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


# checkpoints shared by the test modules: Qwen2 written by 2 TP ranks, Qwen3 by 2 PP ranks
CONVERTED_AT = {"qwen2": (2, 1), "qwen3": (1, 2)}


def _convert(hf: Path, out: Path, name: str) -> Path:
    tp, pp = CONVERTED_AT[name]
    run_cli("hf-to-mcore", "--hf", hf, "--out", out, "--tp", tp, "--pp", pp)
    return out


@pytest.fixture(scope="session")
def qwen2_ckpt(qwen2_dir, tmp_path_factory) -> Path:
    return _convert(qwen2_dir, tmp_path_factory.mktemp("qwen2_mcore") / "ckpt", "qwen2")


@pytest.fixture(scope="session")
def qwen3_ckpt(qwen3_dir, tmp_path_factory) -> Path:
    return _convert(qwen3_dir, tmp_path_factory.mktemp("qwen3_mcore") / "ckpt", "qwen3")
