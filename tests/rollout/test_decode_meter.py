"""The embedded engine's per-round decode meter (`rollout/local/decode_meter.py`): deltas of its own step records
since the last read, against the decode roofline of exactly those steps."""

from __future__ import annotations

import pytest

from mcore_rl.rollout.local.engine import LocalEngine
from mcore_rl.rollout.local.roofline import DecodeCost, decode_roofline
from mcore_rl.rollout.protocol import GenerationRequest, SamplingParams

pytestmark = pytest.mark.rollout


def _gen(engine: LocalEngine, new_tokens: int, n: int) -> None:
    engine.generate([GenerationRequest(list(range(3, 11)), SamplingParams(max_new_tokens=new_tokens, n=n,
                                                                          ignore_eos=True))])


def test_each_read_meters_the_steps_since_the_last_one(tiny_dir):
    with LocalEngine(str(tiny_dir), seed=0) as engine:
        _gen(engine, 5, 2)
        first = engine.speed_metrics()
        assert first["engine_decode_tokens"] == engine.stats.decode_tokens > 0
        assert first["engine_prefill_tokens"] == 8  # the prompt once for both samples
        s = engine.stats
        steps0 = len(s.batch_sizes)
        _gen(engine, 7, 3)
        second = engine.speed_metrics()
        steps = list(zip(list(s.batch_sizes)[steps0:], list(s.kv_lengths)[steps0:]))
        assert len(steps) >= 6 and sum(r for r, _ in steps) == second["engine_decode_tokens"]
        assert second["engine_decode_s"] == pytest.approx(s.decode_s - first["engine_decode_s"])
        gflops, gbs = engine._meter.rates
        bound = decode_roofline(DecodeCost.of(engine.model), steps, gflops, gbs).bound_s
        assert second["engine_decode_bound_s"] == pytest.approx(bound) and bound > 0
        assert second["engine_decode_roofline_frac"] == pytest.approx(bound / second["engine_decode_s"])
        third = engine.speed_metrics()  # nothing ran since
        assert third["engine_decode_tokens"] == 0 and third["engine_decode_bound_s"] == 0
        assert "engine_decode_roofline_frac" not in third


def test_a_model_the_cost_formula_cannot_read_is_not_metered(tiny_dir, monkeypatch, caplog):
    """Telemetry never stops a run: a model whose config the decode cost cannot read gets one warning and no
    engine_decode_* metrics."""
    def unreadable(model):
        raise AttributeError("no text config")

    monkeypatch.setattr(DecodeCost, "of", staticmethod(unreadable))
    with LocalEngine(str(tiny_dir), seed=0) as engine, caplog.at_level("WARNING"):
        _gen(engine, 3, 1)
        assert engine.speed_metrics() == {} and engine.speed_metrics() == {}
    assert caplog.text.count("engine decode roofline not metered for this model (AttributeError") == 1


def test_a_mixture_of_experts_decode_cost_counts_the_experts_a_step_uses():
    """Qwen3-MoE (8 experts, top-2, 4 layers; transformers 5 holds them as 3-D tensors): a row's FLOPs count its two
    experts, a step's bytes the experts its rows pick (two for one row, nearly all eight for a full batch); the
    router stays a dense weight. A dense model keeps no expert terms."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.convert.conftest import qwen3_moe_config

    cfg = qwen3_moe_config()
    moe = DecodeCost.of(AutoModelForCausalLM.from_config(cfg))
    per_layer = 3 * cfg.hidden_size * cfg.moe_intermediate_size  # gate, up and down of one expert
    assert (moe.num_experts, moe.top_k, moe.expert_params) == (8, 2, per_layer * cfg.num_hidden_layers)
    dense_flops = DecodeCost(moe.matmul_params, moe.layers, moe.q_heads, moe.kv_heads, moe.head_dim, 4)
    assert moe.flops(1, 10) - dense_flops.flops(1, 10) == 2 * 2 * moe.expert_params
    assert moe.experts_read(1) == pytest.approx(2.0) and 7.9 < moe.experts_read(64) <= 8.0
    assert moe.bytes(1, 0) == pytest.approx((moe.matmul_params + 2 * moe.expert_params) * 4)
    router = cfg.num_experts * cfg.hidden_size * cfg.num_hidden_layers
    attn = cfg.num_hidden_layers * cfg.hidden_size * cfg.head_dim * (2 * cfg.num_attention_heads
                                                                      + 2 * cfg.num_key_value_heads)
    assert moe.matmul_params == attn + router + cfg.vocab_size * cfg.hidden_size  # + the untied LM head
    llama = DecodeCost.of(AutoModelForCausalLM.from_config(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=512)))
    assert (llama.num_experts, llama.expert_params, llama.experts_read(64)) == (0, 0, 0.0)
