"""Interrupt mode of the local engine (old_logp_source=interrupt|old_logit_model): a weight update restarts the
samples in flight from their prompt, so every sample's tokens carry one version, and the restarted sample is
exactly what the new weights alone would have generated from the same seed."""

from __future__ import annotations

import threading

import pytest

from mcore_rl.rollout.local.engine import LocalEngine
from mcore_rl.rollout.protocol import GenerationRequest, SamplingParams
from mcore_rl.rollout.weight_sync.disk_sync import iter_safetensors

pytestmark = pytest.mark.rollout


def _req(seed: int) -> GenerationRequest:
    return GenerationRequest([5, 6, 7, 8], SamplingParams(max_new_tokens=40, temperature=1.0, seed=seed,
                                                          ignore_eos=True), rid=f"r{seed}")


def _mid_sample_update(engine: LocalEngine) -> list:
    """Submit two samples and return once the first has 5 tokens, with decoding held there (paused in place by
    the engine thread itself, right after that step): the update then lands mid-sample whatever the machine's
    load, where polling from this thread could see the tiny model finish all 40 tokens first."""
    step, held = engine._step, threading.Event()

    def step_then_hold(admit):
        step(admit)
        if not held.is_set() and any(len(r.out) >= 5 for r in engine._batch.rows):
            with engine._cv:
                engine._paused = True
            held.set()

    engine._step = step_then_hold
    futures = engine.submit([_req(1), _req(2)])
    assert held.wait(timeout=120)
    return futures


@pytest.mark.parametrize("interrupt", [True, False])
def test_update_restarts_in_flight_samples(interrupt, tiny_dir, tiny_alt_dir):
    with LocalEngine(str(tiny_dir), seed=0, max_batch_size=1) as eng:
        eng.set_interrupt_on_update(interrupt)
        futures = _mid_sample_update(eng)
        eng.update_weights(iter_safetensors(tiny_alt_dir), version=1)
        eng.resume()
        samples = [f.result(timeout=120) for f in futures]
        regenerated = eng.stats.regenerated
    first = samples[0]
    if not interrupt:  # the control: without interrupt the sample spans both versions
        assert set(first.weight_versions) == {0, 1}
        assert regenerated == 0
        return
    assert regenerated >= 1
    for s in samples:
        assert set(s.weight_versions) == {1} and len(s.output_ids) == 40
    with LocalEngine(str(tiny_alt_dir), seed=0, weight_version=1) as fresh:  # v1 from the start, same seeds
        want = fresh.generate([_req(1), _req(2)])
    for got, ref in zip(samples, want):
        assert got.output_ids == ref.output_ids
        assert max(abs(a - b) for a, b in zip(got.output_logprobs, ref.output_logprobs)) < 1e-5
