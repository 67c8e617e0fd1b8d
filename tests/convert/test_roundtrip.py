"""Tiny random Qwen2 (QKV bias, untied) and Qwen3 (q/k norm, head_dim != hidden/heads, tied): HF -> mcore written
by 2 ranks, logits equal transformers' at another layout (and the same one, slow), mcore -> HF is bit-exact."""

from __future__ import annotations

import json

import pytest
import torch

from mcore_rl.convert.cli import main
from tests.convert.conftest import (
    CONVERTED_AT,
    assert_same_hf_tensors,
    hf_logits,
    max_logit_diff,
    qwen3_config,
    run_cli,
    save_random_model,
)

pytestmark = pytest.mark.convert
FAMILIES = list(CONVERTED_AT)
slow = pytest.mark.slow
VERIFY = [  # (family, verify at (tp, pp)); converted at CONVERTED_AT
    pytest.param("qwen2", (1, 2), id="qwen2-tp2-as-pp2"),
    pytest.param("qwen3", (1, 1), id="qwen3-pp2-as-tp1"),
    pytest.param("qwen2", (2, 1), id="qwen2-tp2-as-tp2", marks=slow),
    pytest.param("qwen3", (1, 2), id="qwen3-pp2-as-pp2", marks=slow),
    pytest.param("qwen3", (2, 1), id="qwen3-pp2-as-tp2", marks=slow),
]


def _case(request, family: str):
    return request.getfixturevalue(f"{family}_dir"), request.getfixturevalue(f"{family}_ckpt")


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_is_self_describing(request, family):
    hf, ckpt = _case(request, family)
    meta = json.loads((ckpt / "complete.json").read_text())
    cfg = json.loads((hf / "config.json").read_text())
    assert meta["architecture"] == cfg["architectures"][0]
    assert meta["vocab_size"] == cfg["vocab_size"] and meta["hf_dtype"] == "fp32"
    assert (meta["saved_tp"], meta["saved_pp"]) == CONVERTED_AT[family]
    assert json.loads((ckpt / "hf" / "config.json").read_text()) == cfg
    assert not list(ckpt.parent.glob(".*partial*"))  # no staging leftovers


@pytest.mark.parametrize("family,layout", VERIFY)
def test_logits_match_transformers(request, family, layout):
    hf, ckpt = _case(request, family)
    tp, pp = layout
    proc = run_cli("verify", "--hf", hf, "--ckpt", ckpt, "--tp", tp, "--pp", pp, "--tol", "1e-4")
    assert max_logit_diff(proc) < 1e-4
    assert "argmax_agree=1.000" in proc.stdout and proc.stdout.rstrip().endswith("OK")


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_bit_exact_and_loads_in_transformers(request, family, tmp_path):
    hf, ckpt = _case(request, family)
    out = tmp_path / "hf_back"
    assert main(["--quiet", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out)]) == 0  # config+dtype: from ckpt
    n = assert_same_hf_tensors(hf, out)
    assert n >= 4 * 9  # every layer's tensors were compared
    assert json.loads((out / "config.json").read_text())["architectures"] == [f"{family.capitalize()}ForCausalLM"]
    tokens = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(3))
    ref, got = hf_logits(hf, tokens), hf_logits(out, tokens)
    assert torch.equal(ref, got)
    assert ref.std() > 0.2  # real, non-degenerate outputs


def test_verify_fails_against_other_weights(qwen3_ckpt, tmp_path):
    """Same architecture, different weights: verify must report a large difference and exit 1."""
    other = save_random_model(tmp_path / "other", qwen3_config(), seed=99)
    proc = run_cli("verify", "--hf", other, "--ckpt", qwen3_ckpt, rc=1)
    assert max_logit_diff(proc) > 1e-2
    assert proc.stdout.rstrip().endswith("FAIL")


def test_bf16_round_trip_is_bit_exact(tmp_path):
    """A bf16 HF model stays bf16 through Megatron and back, tensor for tensor, here into several shards."""
    hf = save_random_model(tmp_path / "bf16", qwen3_config(), seed=5, dtype=torch.bfloat16)
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    run_cli("hf-to-mcore", "--hf", hf, "--out", ckpt)
    assert json.loads((ckpt / "complete.json").read_text())["dtype"] == "bf16"
    assert main(["--quiet", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(back), "--max-shard-size", "60KB"]) == 0
    assert len(list(back.glob("model-*-of-*.safetensors"))) > 1
    assert (back / "model.safetensors.index.json").is_file()
    assert assert_same_hf_tensors(hf, back) > 0
    assert json.loads((back / "config.json").read_text())["dtype"] == "bfloat16"


def test_fp32_checkpoint_exports_as_bf16(qwen2_dir, qwen2_ckpt, tmp_path):
    out = tmp_path / "bf16"
    assert main(["--quiet", "mcore-to-hf", "--ckpt", str(qwen2_ckpt), "--out", str(out), "--dtype", "bf16"]) == 0
    assert assert_same_hf_tensors(qwen2_dir, out, dtype=torch.bfloat16) > 0
