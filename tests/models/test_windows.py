"""Per-layer sliding windows (models/windows.py) against transformers' own configs: which layers are windowed
(transformers computes `layer_types` itself), what Megatron gets, and what stays refused in one line."""

from __future__ import annotations

import pytest

from mcore_rl.models.base import family_for
from mcore_rl.models.fields import UnsupportedConfigError
from mcore_rl.models.spec import BuildConfig, transformer_config_kwargs

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256)


def _hf(config) -> dict:
    arch = type(config).__name__.replace("Config", "ForCausalLM")
    return {**config.to_dict(), "architectures": [arch]}


def _sliding(config) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(config.layer_types) if t == "sliding_attention")


@pytest.mark.parametrize("kw", [
    dict(use_sliding_window=True, sliding_window=32, max_window_layers=2),
    dict(use_sliding_window=True, sliding_window=32, max_window_layers=0),
    dict(use_sliding_window=True, sliding_window=32, max_window_layers=6),
    dict(use_sliding_window=False, sliding_window=32, max_window_layers=2),
    dict(use_sliding_window=True, sliding_window=32, layer_types=["full_attention", "sliding_attention"] * 3),
])
@pytest.mark.parametrize("cls", ["Qwen2Config", "Qwen3Config"])
def test_windowed_layers_follow_transformers(cls, kw):
    import transformers

    config = getattr(transformers, cls)(**SHAPE, **kw)
    hf = _hf(config)
    a = family_for(hf).args(hf)
    want = _sliding(config)
    got = tuple(range(6)) if a.sliding_window and a.window_layers is None else (a.window_layers or ())
    assert got == want
    assert (a.sliding_window is None) == (not want)
    # without layer_types in config.json (files written by transformers < 5), max_window_layers gives the same
    if "layer_types" not in kw:
        b = family_for({k: v for k, v in hf.items() if k != "layer_types"}).args(
            {k: v for k, v in hf.items() if k != "layer_types"})
        assert (b.sliding_window, b.window_layers) == (a.sliding_window, a.window_layers)


def test_megatron_gets_a_per_layer_list():
    from transformers import Qwen2Config

    hf = _hf(Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=32, max_window_layers=4))
    kw = transformer_config_kwargs(family_for(hf).args(hf), BuildConfig())
    assert kw["window_size"] == (31, 0) and kw["window_attn_skip_freq"] == [0, 0, 0, 0, 1, 1]
    hf = _hf(Qwen2Config(**SHAPE))
    kw = transformer_config_kwargs(family_for(hf).args(hf), BuildConfig())
    assert kw["window_size"] is None and kw["window_attn_skip_freq"] is None


@pytest.mark.parametrize("cfg,field", [
    # the MoE families' attention is Megatron's local one: windows stay refused (layer_types is checked first)
    (dict(model_type="qwen2_moe", use_sliding_window=True, sliding_window=32), "(layer_types|use_sliding_window)"),
    (dict(model_type="qwen3_moe", use_sliding_window=True, sliding_window=32), "(sliding_window|use_sliding_window)"),
    (dict(model_type="qwen2", layer_types=["sliding_attention"] * 6), "layer_types"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=32, layer_types=["chunked_attention"] * 6),
     "layer_types"),
])
def test_refused_in_one_line(cfg, field):
    from transformers import AutoConfig

    config = AutoConfig.for_model(cfg.pop("model_type"), **SHAPE, **cfg)
    hf = _hf(config)
    with pytest.raises(UnsupportedConfigError, match=rf"^config field {field}=") as e:
        family_for(hf).args(hf)
    assert "\n" not in str(e.value)
