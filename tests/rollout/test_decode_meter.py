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
