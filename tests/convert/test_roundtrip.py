"""Tiny random Qwen2 (QKV bias, untied) and Qwen3 (q/k norm, head_dim != hidden/heads, tied): HF -> mcore at one
layout, logits equal transformers' at that layout and at another one, and mcore -> HF is bit-exact."""

from __future__ import annotations

import json

import pytest
import torch

from tests.convert.conftest import (
    assert_same_hf_tensors,
    hf_logits,
    max_logit_diff,
    qwen3_config,
    run_cli,
    save_random_model,
)

pytestmark = pytest.mark.convert

# family: (converted at (tp, pp), verified at other (tp, pp))
CASES = {"qwen2": ((2, 1), (1, 2)), "qwen3": ((1, 2), (2, 1))}


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory):
    name = request.param
    hf = request.getfixturevalue(f"{name}_dir")
    (tp, pp), _ = CASES[name]
    ckpt = tmp_path_factory.mktemp(f"{name}_mcore") / "ckpt"
    run_cli("hf-to-mcore", "--hf", hf, "--out", ckpt, "--tp", tp, "--pp", pp)
    return name, hf, ckpt


def test_checkpoint_is_self_describing(converted):
    name, hf, ckpt = converted
    meta = json.loads((ckpt / "complete.json").read_text())
    cfg = json.loads((hf / "config.json").read_text())
    assert meta["architecture"] == cfg["architectures"][0]
    assert meta["vocab_size"] == cfg["vocab_size"] and meta["hf_dtype"] == "fp32"
    assert (ckpt / "hf" / "config.json").is_file()
    assert not list(ckpt.parent.glob(".*partial*"))  # no staging leftovers


@pytest.mark.parametrize("layout", ["same", "cross"])
def test_logits_match_transformers(converted, layout):
    name, hf, ckpt = converted
    same, cross = CASES[name]
    tp, pp = same if layout == "same" else cross
    proc = run_cli("verify", "--hf", hf, "--ckpt", ckpt, "--tp", tp, "--pp", pp, "--tol", "1e-4")
    assert max_logit_diff(proc) < 1e-4
    assert "argmax_agree=1.000" in proc.stdout


def test_round_trip_bit_exact_and_loads_in_transformers(converted, tmp_path):
    name, hf, ckpt = converted
    out = tmp_path / "hf_back"
    run_cli("mcore-to-hf", "--ckpt", ckpt, "--out", out)  # config + dtype come from the checkpoint itself
    n = assert_same_hf_tensors(hf, out)
    assert n >= 4 * 9  # every layer's tensors were compared
    assert json.loads((out / "config.json").read_text())["architectures"] == [f"{name.capitalize()}ForCausalLM"]
    tokens = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(3))
    ref, got = hf_logits(hf, tokens), hf_logits(out, tokens)
    assert torch.equal(ref, got)
    assert ref.std() > 0.5  # real, non-degenerate outputs


def test_verify_fails_against_other_weights(converted, tmp_path):
    """Same architecture, different weights: verify must report a large difference and exit 1."""
    name, _, ckpt = converted
    if name != "qwen3":
        pytest.skip("one family is enough for the negative check")
    other = save_random_model(tmp_path / "other", qwen3_config(), seed=99)
    proc = run_cli("verify", "--hf", other, "--ckpt", ckpt, rc=1)
    assert max_logit_diff(proc) > 1e-2
    assert "FAIL" in proc.stdout


def test_bf16_round_trip_is_bit_exact(tmp_path):
    """A bf16 HF model stays bf16 through Megatron and back, tensor for tensor."""
    hf = save_random_model(tmp_path / "bf16", qwen3_config(), seed=5, dtype=torch.bfloat16)
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    run_cli("hf-to-mcore", "--hf", hf, "--out", ckpt, "--tp", 2)
    assert json.loads((ckpt / "complete.json").read_text())["dtype"] == "bf16"
    run_cli("mcore-to-hf", "--ckpt", ckpt, "--out", back, "--max-shard-size", "60KB")
    assert len(list(back.glob("model-*-of-*.safetensors"))) > 1  # sharded, with an index
    assert (back / "model.safetensors.index.json").is_file()
    assert assert_same_hf_tensors(hf, back) > 0
    assert json.loads((back / "config.json").read_text())["dtype"] == "bfloat16"
