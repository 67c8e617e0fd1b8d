"""rollout.weight_layout (mcore_rl/rollout/local/weight_layout.py): forced layouts are taken as given; `auto` keeps
PyTorch's [out, in] wherever the choice cannot pay or cannot be timed reliably (CUDA, bf16, small or uncovered
models) and otherwise follows the measured ratio against MIN_SPEEDUP; a bad value is one config error."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from mcore_rl.config import ConfigError
from mcore_rl.config.rollout import LocalRolloutConfig
from mcore_rl.rollout.local import weight_layout as wl

pytestmark = pytest.mark.rollout
CPU = torch.device("cpu")
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=64)  # fmt: skip


def _llama(**fields) -> torch.nn.Module:
    return LlamaForCausalLM(LlamaConfig(**{**SHAPE, **fields})).eval()


@pytest.mark.parametrize("mode", ["out", "in"])
def test_forced_layouts_are_taken_as_given(mode):
    choice = wl.choose(_llama(hidden_size=64), mode, CPU, torch.float32)
    assert choice.in_major == (mode == "in") and not choice.measured and choice.name == mode


@pytest.mark.parametrize(("model", "device", "dtype", "why"), [
    (dict(hidden_size=64), CPU, torch.float32, "hidden size below 256"),
    ({}, torch.device("cuda"), torch.float32, "cuda keeps"),
    ({}, CPU, torch.bfloat16, "bfloat16 keeps"),
])  # fmt: skip
def test_auto_keeps_pytorchs_layout_where_timing_cannot_pay(monkeypatch, model, device, dtype, why):
    monkeypatch.setattr(wl, "measure", lambda *a, **k: pytest.fail("measured where it should not"))
    choice = wl.choose(_llama(**model), "auto", device, dtype)
    assert not choice.in_major and not choice.measured and why in choice.why


def test_auto_keeps_the_layout_for_models_the_fused_forward_does_not_cover(monkeypatch):
    monkeypatch.setattr(wl, "measure", lambda *a, **k: pytest.fail("measured where it should not"))
    windowed = MistralForCausalLM(MistralConfig(**SHAPE, head_dim=64, sliding_window=8)).eval()
    choice = wl.choose(windowed, "auto", CPU, torch.float32)
    assert not choice.in_major and "own decode forward" in choice.why


@pytest.mark.parametrize(("t_out", "t_in", "in_major"), [(1.30, 1.0, True), (1.15, 1.0, True), (1.10, 1.0, False),
                                                         (0.80, 1.0, False)])
def test_auto_follows_the_measured_ratio(monkeypatch, t_out, t_in, in_major):
    shapes = []
    monkeypatch.setattr(wl, "measure", lambda s, dtype: shapes.append(s) or (t_out, t_in))
    choice = wl.choose(_llama(), "auto", CPU, torch.float32)
    assert choice.in_major == in_major and choice.measured and f"{t_out / t_in:.2f}x" in choice.why
    # one layer's decode GEMMs: fused q/k/v (4 + 2 + 2 heads of 64), o, fused gate/up, down
    assert shapes == [[(512, 256), (256, 256), (1024, 256), (256, 512)]]


def test_measure_times_both_layouts_on_one_thread():
    threads = torch.get_num_threads()
    t_out, t_in = wl.measure([(64, 32), (32, 64)], torch.float32, rows=(2, 8), repeats=2)
    assert t_out > 0 and t_in > 0 and torch.get_num_threads() == threads


def test_bad_values_are_one_line_errors():
    with pytest.raises(ConfigError, match="rollout.weight_layout"):
        LocalRolloutConfig(weight_layout="column")
    with pytest.raises(ValueError, match="rollout.weight_layout='column'"):
        wl.choose(_llama(), "column", CPU, torch.float32)
