"""Tiny random Qwen3-MoE (4 layers, 8 experts, top-2): HF -> Megatron written by EP=2 ranks, logits equal
transformers' at other TP/PP/EP layouts (slow ones: ~20-50 s each on a quiet 2-core machine), and Megatron -> HF is
bit-exact (every expert tensor)."""

from __future__ import annotations

import json

import pytest
import torch

from mcore_rl.convert.cli import main
from tests.convert.conftest import (
    assert_same_hf_tensors,
    hf_logits,
    max_logit_diff,
    qwen3_moe_config,
    run_cli,
    save_random_model,
)

pytestmark = pytest.mark.convert
slow = pytest.mark.slow
VERIFY = [  # verify at (tp, pp, ep) a checkpoint written at ep=2 (4 ranks at most)
    pytest.param((1, 1, 1), id="single"),
    pytest.param((1, 1, 2), id="ep2", marks=slow),
    pytest.param((2, 1, 1), id="tp2", marks=slow),
    pytest.param((1, 2, 1), id="pp2", marks=slow),
    pytest.param((2, 1, 2), id="tp2ep2", marks=slow),
    pytest.param((1, 2, 2), id="pp2ep2", marks=slow),
]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return save_random_model(tmp_path_factory.mktemp("qwen3_moe"), qwen3_moe_config(), seed=4)


@pytest.fixture(scope="module")
def moe_ckpt(moe_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_moe_mcore") / "ckpt"
    run_cli("hf-to-mcore", "--hf", moe_dir, "--out", out, "--ep", 2)
    return out


@slow
def test_tp2ep2_conversion_verifies(moe_dir, tmp_path):
    """Written by TP=2 x EP=2 ranks (4 processes), read back at PP=2 x EP=2."""
    out = tmp_path / "ckpt"
    run_cli("hf-to-mcore", "--hf", moe_dir, "--out", out, "--tp", 2, "--ep", 2)
    proc = run_cli("verify", "--hf", moe_dir, "--ckpt", out, "--pp", 2, "--ep", 2, "--tol", "1e-5")
    assert max_logit_diff(proc) <= 1e-5


def test_checkpoint_records_expert_layout(moe_ckpt):
    meta = json.loads((moe_ckpt / "complete.json").read_text())
    assert meta["architecture"] == "Qwen3MoeForCausalLM"
    assert (meta["saved_tp"], meta["saved_pp"], meta["saved_ep"]) == (1, 1, 2)


@pytest.mark.parametrize("layout", VERIFY)
def test_moe_logits_match_transformers(moe_dir, moe_ckpt, layout):
    tp, pp, ep = layout
    tokens = 1100 if layout == (1, 1, 1) else 48  # the long prompt once, at TP=1 (the slow layouts: the short one)
    proc = run_cli("verify", "--hf", moe_dir, "--ckpt", moe_ckpt, "--tp", tp, "--pp", pp, "--ep", ep,
                   "--tokens", tokens, "--tol", "1e-5")
    assert max_logit_diff(proc) <= 1e-5
    assert "argmax_agree=1.000" in proc.stdout and " OK" in proc.stdout


def test_moe_round_trip_bit_exact(moe_dir, moe_ckpt, tmp_path):
    out = tmp_path / "hf_back"
    assert main(["--quiet", "mcore-to-hf", "--ckpt", str(moe_ckpt), "--out", str(out)]) == 0
    n = assert_same_hf_tensors(moe_dir, out)
    assert n == 3 + 4 * (8 + 1 + 8 * 3)  # embed/norm/head + per layer: attention + norms, router, 8 x 3 experts
    tokens = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(3))
    ref, got = hf_logits(moe_dir, tokens), hf_logits(out, tokens)
    assert torch.equal(ref, got) and ref.std() > 0.1


def test_verify_catches_swapped_experts(moe_dir, moe_ckpt, tmp_path):
    """Two experts exchanged in the HF folder: same shapes, different model -> verify exits 1."""
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "swapped"
    bad.mkdir()
    state = load_file(moe_dir / "model.safetensors")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        a, b = f"model.layers.0.mlp.experts.0.{proj}.weight", f"model.layers.0.mlp.experts.1.{proj}.weight"
        state[a], state[b] = state[b], state[a]
    save_file(state, bad / "model.safetensors", metadata={"format": "pt"})
    (bad / "config.json").write_text((moe_dir / "config.json").read_text())
    proc = run_cli("verify", "--hf", bad, "--ckpt", moe_ckpt, rc=1)
    assert max_logit_diff(proc) > 1e-3
