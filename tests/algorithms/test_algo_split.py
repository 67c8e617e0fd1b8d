"""The loss gradient does not depend on how a batch is cut into micro-batches (every mode, every algorithm)."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.algorithms import AGG_MODES, compute_ess, registered_algorithms
from tests.algorithms.algo_testlib import build, make_rollout, run_step

pytestmark = pytest.mark.algorithms


def overrides(name: str, mode: str) -> dict:
    kw: dict = {"loss_agg_mode": mode, "max_response_len": 16}
    if name == "dapo":
        kw["overlong_buffer_len"] = 6          # active: some responses are longer than 16 - 6
    if name == "p3o":
        kw["ess_scope"] = "batch"
    if name == "ppo_ewma":
        kw.update(ti_level="token", ti_low=0.8, ti_high=1.25)
    return kw


def run(name: str, mode: str, splits: int, ro):
    alg = build(name, **overrides(name, mode))
    if name == "p3o":
        alg.set_batch_ess(compute_ess(ro.logp, ro.rollout_logp, ro.mask))
    return run_step(alg, ro, splits)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", registered_algorithms())
def test_four_micro_batches_equal_one(name, mode, dtype):
    ro = make_rollout(seed=11, dtype=dtype)
    one, four = run(name, mode, 1, ro), run(name, mode, 4, ro)
    assert one.grad_logp.abs().max() > 0
    assert float((one.grad_logp - four.grad_logp).abs().max()) < 1e-6
    assert one.grad_logp.dtype == dtype
    assert four.loss == pytest.approx(one.loss, abs=1e-6 if dtype == torch.float64 else 1e-4)
    assert one.step_metrics == pytest.approx(four.step_metrics, abs=1e-9 if dtype == torch.float64 else 1e-6)
    if name == "mu_grpo":
        assert one.step_metrics["nav_vetoed_frac"] > 0 and one.step_metrics["grad_scale"] > 1


def test_mu_grpo_microbatch_renorm_matches_deferred_on_one_micro_batch():
    ro = make_rollout(seed=5)
    deferred = run_step(build("mu_grpo"), ro, 1)
    micro = run_step(build("mu_grpo", renorm_dropped="microbatch"), ro, 1)
    none = run_step(build("mu_grpo", renorm_dropped="none"), ro, 1)
    assert torch.allclose(deferred.grad_logp, micro.grad_logp, atol=1e-15)
    assert micro.step_metrics["grad_scale"] == 1.0
    assert torch.allclose(deferred.grad_logp, none.grad_logp * deferred.step_metrics["grad_scale"], atol=1e-15)


def test_p3o_microbatch_scope_on_one_micro_batch_equals_batch_scope():
    ro = make_rollout(seed=7)
    micro = run_step(build("p3o"), ro, 1)
    alg = build("p3o", ess_scope="batch")
    alg.set_batch_ess(compute_ess(ro.logp, ro.rollout_logp, ro.mask))
    batch = run_step(alg, ro, 1)
    assert torch.allclose(micro.grad_logp, batch.grad_logp, atol=1e-15)
    with pytest.raises(RuntimeError, match="set_batch_ess"):
        run_step(alg, ro, 1)                       # the batch ESS is consumed by finish_accumulation
