"""The families people post-train, at tiny size, from transformers' own config classes: Llama 3.x RoPE (llama3
frequency bands), linear and YaRN RoPE scaling (incl. YaRN's attention factor), Mistral with and without a sliding
window, Qwen2 / Qwen3 with per-layer sliding windows, Llama with biases and GELU. Each converts HF -> Megatron, gives transformers' logits (max |diff| <= 1e-5, fp32) on a short prompt and
on a 1100-token one (positions far beyond `original_max_position_embeddings`=256 and beyond the window), and comes
back bit-exact."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mcore_rl.convert.cli import main
from tests.convert.conftest import (
    assert_same_hf_tensors,
    max_logit_diff,
    run_cli,
    run_cli_batch,
    save_random_model,
)

pytestmark = pytest.mark.convert
slow = pytest.mark.slow
TOL = 1e-5
LONG = 1100  # > 4 x original context (256) and > 17 x Mistral's tiny window (64)
_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=512, rms_norm_eps=1e-5)


def llama3_config():
    """Llama 3.2-1B shape at tiny size: tied embeddings, GQA, llama3 RoPE bands over a 256-token original context
    (head_dim 16: wavelengths 6..2e4 tokens fall in all three bands)."""
    from transformers import LlamaConfig

    return LlamaConfig(**_SHAPE, tie_word_embeddings=True, max_position_embeddings=2048, rope_parameters=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=256, rope_theta=10000.0))


def linear_config():
    from transformers import LlamaConfig

    return LlamaConfig(**_SHAPE, max_position_embeddings=2048,
                       rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=10000.0))


def qwen3_yarn_config():
    """Qwen3 long-context shape: q/k norm, head_dim != hidden/heads, YaRN x4 (attention factor 1 + 0.1 ln 4)."""
    from transformers import Qwen3Config

    return Qwen3Config(**_SHAPE, head_dim=32, tie_word_embeddings=True, max_position_embeddings=1024,
                       rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=256,
                                            rope_theta=10000.0))


def qwen2_yarn_mscale_config():
    """Qwen2.5 (QKV bias) with DeepSeek-style YaRN: mscale / mscale_all_dim, beta_fast 16, untruncated ramp."""
    from transformers import Qwen2Config

    return Qwen2Config(**_SHAPE, max_position_embeddings=1024, rope_parameters=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=256, mscale=0.707, mscale_all_dim=1.0,
        beta_fast=16, truncate=False, rope_theta=10000.0))


def mistral_config(sliding_window: int | None = None):
    """Mistral-7B shape at tiny size: GQA, head_dim 16, untied head; v0.1 has a 4096-token window (here 64)."""
    from transformers import MistralConfig

    return MistralConfig(**_SHAPE, head_dim=16, max_position_embeddings=2048, sliding_window=sliding_window,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0))


def llama_bias_gelu_config():
    """Llama-architecture custom model: q/k/v/o and gate/up/down biases, tanh-approximated GELU."""
    from transformers import LlamaConfig

    return LlamaConfig(**_SHAPE, attention_bias=True, mlp_bias=True, hidden_act="gelu_pytorch_tanh",
                       max_position_embeddings=2048, rope_parameters=dict(rope_type="default", rope_theta=1e4))


def qwen2_window_config():
    """Qwen2.5 with `use_sliding_window`: layer 0 full (max_window_layers=1), layer 1 within a 64-token window."""
    from transformers import Qwen2Config

    return Qwen2Config(**_SHAPE, max_position_embeddings=2048, use_sliding_window=True, sliding_window=64,
                       max_window_layers=1)


def qwen3_layer_types_config():
    """Qwen3 with explicit `layer_types`: layer 0 within a 64-token window, layer 1 full (the reverse of Qwen2's
    max_window_layers order, so the per-layer list is what is read)."""
    from transformers import Qwen3Config

    return Qwen3Config(**_SHAPE, head_dim=32, max_position_embeddings=2048, use_sliding_window=True,
                       sliding_window=64, layer_types=["sliding_attention", "full_attention"])


CONFIGS = {"llama3": llama3_config, "linear": linear_config, "qwen3-yarn": qwen3_yarn_config,
           "qwen2-yarn-mscale": qwen2_yarn_mscale_config, "mistral": mistral_config,
           "mistral-window": lambda: mistral_config(64), "llama-bias-gelu": llama_bias_gelu_config,
           "qwen2-window": qwen2_window_config, "qwen3-layer-types": qwen3_layer_types_config}
NAMES = list(CONFIGS)


def _with_config(src: Path, dst: Path, **changes) -> Path:
    """A copy of HF folder `src` whose config.json has `changes` applied (same weights, other architecture)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


def _verify_args(hf, ckpt, tokens: int, tp: int = 1, pp: int = 1) -> list:
    return ["verify", "--hf", hf, "--ckpt", ckpt, "--tokens", tokens, "--tp", tp, "--pp", pp, "--tol", TOL]


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict:
    """Every family converted at TP=1 and checked against transformers on the LONG prompt, and the two controls
    below, as CLI commands in one interpreter (run_cli_batch: one start-up instead of twenty)."""
    root = tmp_path_factory.mktemp("families")
    hf = {n: save_random_model(root / n / "hf", CONFIGS[n](), seed=7) for n in NAMES}
    ckpt = {n: root / n / "ckpt" for n in NAMES}
    plain = _with_config(hf["llama3"], root / "plain", rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    uniform = _with_config(hf["qwen2-window"], root / "uniform", layer_types=["sliding_attention"] * 2)
    calls = [["hf-to-mcore", "--hf", hf[n], "--out", ckpt[n]] for n in NAMES]
    calls += [_verify_args(hf[n], ckpt[n], LONG) for n in NAMES]
    calls += [_verify_args(plain, ckpt["llama3"], LONG), _verify_args(uniform, ckpt["qwen2-window"], LONG)]
    res = run_cli_batch(calls, root)
    for r in res[: len(NAMES)]:
        assert r.returncode == 0, f"{r.args}: {r.stderr[-3000:]}"
    return {"hf": hf, "ckpt": ckpt, "verify": dict(zip(NAMES, res[len(NAMES): 2 * len(NAMES)])),
            "plain": res[-2], "uniform": res[-1]}


@pytest.fixture(scope="module")
def converted(families):
    """name -> (hf folder, checkpoint written at TP=1)."""
    return lambda name: (families["hf"][name], families["ckpt"][name])


def _verify(hf, ckpt, tokens: int, tp: int = 1, pp: int = 1) -> float:
    return _checked(run_cli(*_verify_args(hf, ckpt, tokens, tp, pp)), tokens)


def _checked(proc, tokens: int) -> float:
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.rstrip().endswith("OK") and f"tokens={tokens}" in proc.stdout
    return max_logit_diff(proc)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers_tp1(families, name):
    """The LONG prompt checks every position from 0 on in one forward: positions 0..47 (inside the original
    context and the window) are the short prompt's check below."""
    assert _checked(families["verify"][name], LONG) <= TOL


@slow
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers_short_prompt(converted, name):
    hf, ckpt = converted(name)
    assert _verify(hf, ckpt, 48) <= TOL


@slow
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_logits_match_transformers_tp2_pp2(converted, name, layout):
    hf, ckpt = converted(name)
    assert _verify(hf, ckpt, LONG, *layout) <= TOL


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_bit_exact(converted, name, tmp_path):
    hf, ckpt = converted(name)
    assert main(["--quiet", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "back")]) == 0
    assert assert_same_hf_tensors(hf, tmp_path / "back") >= 2 * 9


def test_rope_scaling_changes_the_long_logits(families):
    """The llama3 bands matter: the same weights under plain RoPE differ from transformers' llama3 logits on the
    long prompt, so the exactness above is not an accident of tiny frequencies."""
    proc = families["plain"]
    assert proc.returncode == 1 and proc.stdout.rstrip().endswith("FAIL"), proc.stdout + proc.stderr[-2000:]
    assert max_logit_diff(proc) > 1e-2


def test_per_layer_windows_matter(families):
    """Qwen2's window sits on layer 1 only: the same weights with the window on every layer (a Mistral-style
    uniform window) differ from transformers' logits on the long prompt, so the per-layer list is really read."""
    proc = families["uniform"]
    assert proc.returncode == 1 and proc.stdout.rstrip().endswith("FAIL"), proc.stdout + proc.stderr[-2000:]
    assert max_logit_diff(proc) > 1e-2
