"""RoPE variants (models/rope.py) against transformers' own RoPE functions, bit for bit; YaRN's attention factor
as Megatron's softmax scale; the SDPA sliding window against an explicit masked softmax."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_rl.models.base import family_for
from mcore_rl.models.fields import UnsupportedConfigError
from mcore_rl.models.rope import attention_factor, inv_freq, softmax_scale


def _cases():
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    small = dict(hidden_size=64, num_attention_heads=4)
    return {
        "default": LlamaConfig(**small, rope_parameters=dict(rope_type="default", rope_theta=500000.0)),
        "linear": LlamaConfig(**small, rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=1e4)),
        "llama3-3.2": LlamaConfig(**small, max_position_embeddings=131072, rope_parameters=dict(
            rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192, rope_theta=500000.0)),
        "llama3-other-bands": LlamaConfig(**small, max_position_embeddings=2048, rope_parameters=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=2.0, high_freq_factor=8.0,
            original_max_position_embeddings=256, rope_theta=10000.0)),
        "yarn-qwen3": Qwen3Config(**small, head_dim=128, max_position_embeddings=131072, rope_parameters=dict(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=32768, rope_theta=1000000.0)),
        "yarn-mscale": Qwen2Config(**small, max_position_embeddings=1024, rope_parameters=dict(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=256, mscale=0.707, mscale_all_dim=1.0,
            beta_fast=16, beta_slow=2, truncate=False, rope_theta=10000.0)),
        "yarn-attention-factor": Qwen2Config(**small, max_position_embeddings=1024, rope_parameters=dict(
            rope_type="yarn", factor=4.0, attention_factor=1.25, original_max_position_embeddings=256,
            rope_theta=10000.0)),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_frequencies_and_attention_factor_equal_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _cases()[name]
    hf = {**config.to_dict(), "architectures": [type(config).__name__.replace("Config", "ForCausalLM")]}
    a = family_for(hf).args(hf)
    kind = config.rope_parameters["rope_type"]
    if kind == "default":
        head = a.head_dim
        ref, ref_factor = 1.0 / (500000.0 ** (torch.arange(0, head, 2).float() / head)), 1.0
    else:
        ref, ref_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    got = inv_freq(a.rope, a.head_dim)
    assert got.dtype == torch.float32 and torch.equal(got, ref), (got - ref).abs().max()
    assert attention_factor(a.rope) == pytest.approx(ref_factor, abs=0, rel=1e-15)
    if kind != "default":
        assert not torch.equal(got, inv_freq(type(a.rope)("default", a.rope.theta), a.head_dim))  # it scales


def test_yarn_attention_factor_is_the_softmax_scale():
    """q*m . k*m / sqrt(d) == q . k * (m^2 / sqrt(d)): the factor moves into Megatron's softmax_scale."""
    config = _cases()["yarn-qwen3"]
    hf = {**config.to_dict(), "architectures": ["Qwen3ForCausalLM"]}
    a = family_for(hf).args(hf)
    m = 0.1 * math.log(4.0) + 1.0
    assert softmax_scale(a.rope, 128) == pytest.approx(m * m / math.sqrt(128), rel=1e-15)
    from mcore_rl.models.spec import BuildConfig, transformer_config_kwargs

    assert transformer_config_kwargs(a, BuildConfig())["softmax_scale"] == softmax_scale(a.rope, 128)
    plain = {**hf, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    assert transformer_config_kwargs(family_for(plain).args(plain), BuildConfig())["softmax_scale"] is None


@pytest.mark.parametrize("rope,words", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope type 'dynamic' is not implemented"),
    ({"rope_type": "linear"}, "linear RoPE needs ['factor']"),
    ({"rope_type": "yarn", "factor": 4.0, "long_factor": [1.0]}, "keys ['long_factor'] are not implemented"),
    ({"rope_type": "default", "factor": 2.0}, "keys ['factor'] are not implemented for default RoPE"),
])
def test_unreproducible_rope_is_refused_in_one_line(rope, words):
    from transformers import LlamaConfig

    hf = {**LlamaConfig().to_dict(), "architectures": ["LlamaForCausalLM"], "rope_parameters": rope}
    with pytest.raises(UnsupportedConfigError) as e:
        family_for(hf).args(hf)
    assert words in str(e.value) and "\n" not in str(e.value) and "rope_parameters=" in str(e.value)


def test_mistral_window_becomes_megatron_window_size():
    from transformers import MistralConfig

    from mcore_rl.models.spec import BuildConfig, transformer_config_kwargs

    for window, want in ((4096, (4095, 0)), (None, None)):
        hf = {**MistralConfig(sliding_window=window).to_dict(), "architectures": ["MistralForCausalLM"]}
        a = family_for(hf).args(hf)
        assert a.sliding_window == window
        assert transformer_config_kwargs(a, BuildConfig())["window_size"] == want


def test_sdpa_window_mask_equals_explicit_softmax():
    """Key j is visible from query i iff i - w < j <= i (HF's sliding window, w = left + 1)."""
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType

    from mcore_rl.models.sdpa_attention import SdpaAttention

    torch.manual_seed(0)
    s, heads, d, w = 40, 2, 8, 5
    q, k, v = (torch.randn(s, 1, heads, d) for _ in range(3))
    layer = SdpaAttention.__new__(SdpaAttention)
    torch.nn.Module.__init__(layer)
    layer.__dict__.update(attn_mask_type=AttnMaskType.causal, heads=heads, groups=heads, window_left=w - 1,
                          hidden_size_per_partition=heads * d, softmax_scale=d ** -0.5, dropout_p=0.0,
                          config=SimpleNamespace())
    got = layer(q, k, v, None).reshape(s, heads, d)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = (j <= i) & (j > i - w)
    scores = torch.einsum("ihd,jhd->hij", q[:, 0], k[:, 0]) * d ** -0.5
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    ref = torch.einsum("hij,jhd->ihd", probs, v[:, 0])
    assert (got - ref).abs().max() < 1e-6
    layer.window_left = None  # full causal differs from the windowed result past the window
    assert (layer(q, k, v, None).reshape(s, heads, d) - ref).abs().max() > 1e-2
