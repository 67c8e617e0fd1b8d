"""PPO-EWMA's two routes (exact pi_old vs EWMA proximal), its staleness-aware gate, the reset rule and the
configurations it refuses."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_rl.algorithms import EwmaWeights
from tests.algorithms.algo_testlib import Rollout, build, make_rollout, run_step

pytestmark = pytest.mark.algorithms
D = torch.float64
ASYNC2 = {"schedule": "async", "max_staleness": 2, "updates_per_rollout": 1}


def ppo_grad(logp, anchor, adv, eps=0.2):
    r = torch.exp(logp - anchor)
    inside = ((adv >= 0) & (r <= 1 + eps)) | ((adv < 0) & (r >= 1 - eps))
    return -adv * r * inside


def shifted(rows: int = 4, t: int = 6, prox: float = 0.0, theta: float = 0.0, old: float = 0.0) -> Rollout:
    """Every row's log-probs = the engine's + a constant per policy (geometric log d = that constant)."""
    g = torch.Generator().manual_seed(0)
    infer = -1.0 - torch.rand(rows, t, generator=g, dtype=D)
    mask = torch.ones(rows, t, dtype=D)
    z = torch.zeros(rows, t, dtype=D)
    return Rollout(torch.arange(rows, dtype=D), torch.arange(rows) // 2, mask, infer + theta, infer,
                   infer + old, infer + prox, infer, z)


def step(alg, ro, adv: float = 1.0):
    return run_step(alg, ro, adv=torch.full((ro.mask.shape[0],), adv, dtype=D))


def test_exact_route_reads_old_logits_not_prox():
    ro = make_rollout(seed=5, veto_tokens=0)
    alg = build("ppo_ewma", old_logp_source="snapshot", ti_level="token", ti_low=0.9, ti_high=1.1)
    assert alg.needs_old_logp and not alg.needs_prox_logp
    assert alg.config.ewma_beta is None and alg.config.auto_reset is None
    res = run_step(alg, ro)
    d = torch.exp(ro.old_logp - ro.rollout_logp)
    keep = ((d >= 0.9) & (d <= 1.1) & (ro.mask > 0)).to(D)
    assert 0 < keep[ro.mask > 0].mean() < 1
    assert res.step_metrics["ti_keep_rate"] == pytest.approx(float(keep.sum() / ro.mask.sum()), abs=1e-12)
    adv = alg.advantages(ro.rewards, ro.group_ids).advantages.to(D)[:, None].expand_as(ro.mask)
    w = alg.token_weights(ro.mask, ro.group_ids)
    want = w * ppo_grad(ro.logp, ro.old_logp, adv) * keep
    assert torch.allclose(res.grad_logp, want, atol=1e-12)
    ro.prox_logp = ro.prox_logp + 3.0                                 # the proximal log-probs are not read
    assert torch.equal(run_step(alg, ro).grad_logp, res.grad_logp)
    assert alg.after_optimizer_step(res.step_metrics).reset_ewma is False


def test_exact_route_with_exact_ti_keeps_everything_at_any_staleness():
    """d = pi_old / pi_infer compares like with like: staleness (theta far from old) leaves the mask alone."""
    ro = shifted(old=0.0, theta=0.15, prox=0.9)
    alg = build("ppo_ewma", old_logp_source="snapshot", **ASYNC2)
    res = step(alg, ro)
    assert res.step_metrics["ti_keep_rate"] == 1.0 and res.metrics[0]["ti_ratio_mean"] == 1.0
    assert res.grad_logp.abs().min() > 0


def test_ewma_route_gate_is_widened_by_the_staleness_the_clip_allows():
    alg = build("ppo_ewma", **ASYNC2)                                 # L = 2 steps, fresh EWMA: age 0
    assert alg.config.lag_steps == 2 and alg.config.ewma_beta == 0.75
    hi = math.log(1.005) + 2 * math.log(1.2)
    assert step(alg, shifted(prox=hi - 1e-3)).step_metrics["ti_keep_rate"] == 1.0
    assert step(alg, shifted(prox=hi + 1e-3)).step_metrics["ti_keep_rate"] == 0.0
    lo = math.log(0.995) + 2 * math.log(0.8)
    assert step(alg, shifted(prox=lo + 1e-3)).step_metrics["ti_keep_rate"] == 1.0
    assert step(alg, shifted(prox=lo - 1e-3)).step_metrics["ti_keep_rate"] == 0.0
    alg.after_optimizer_step({"ti_keep_rate": 1.0, "step_clipfrac": 0.0})  # age 0.75 / 1.75
    hi2 = math.log(1.005) + (2 + 0.75 / 1.75) * math.log(1.2)
    assert alg.ewma_age == pytest.approx(0.75 / 1.75, rel=1e-12)
    assert step(alg, shifted(prox=hi2 - 1e-3)).step_metrics["ti_keep_rate"] == 1.0
    assert step(alg, shifted(prox=hi2 + 1e-3)).step_metrics["ti_keep_rate"] == 0.0
    sync1 = build("ppo_ewma", updates_per_rollout=1)                  # on-policy, fresh: the plain TI bounds
    assert step(sync1, shifted(prox=0.004)).step_metrics["ti_keep_rate"] == 1.0
    assert step(sync1, shifted(prox=0.006)).step_metrics["ti_keep_rate"] == 0.0


def test_sequence_level_widening_scales_with_length():
    alg = build("ppo_ewma", ti_level="sequence", ti_low=0.9, ti_high=1.1, **ASYNC2)
    per_tok = (math.log(1.1) + 2 * 6 * math.log(1.2)) / 6             # 6 tokens a row
    assert step(alg, shifted(prox=per_tok - 1e-4)).step_metrics["ti_keep_rate"] == 1.0
    assert step(alg, shifted(prox=per_tok + 1e-4)).step_metrics["ti_keep_rate"] == 0.0


def test_reset_does_not_fire_when_theta_is_further_from_the_behaviour_policy():
    """The issue's case: async k=2, theta_bar drifted out of the gate and theta further still. A reset would
    make the anchor theta (further away), so it does not fire; it does when theta would keep the tokens."""
    alg = build("ppo_ewma", **ASYNC2)
    res = step(alg, shifted(prox=0.45, theta=0.6))
    assert res.step_metrics["ti_keep_rate"] == 0.0 and res.step_metrics["ti_keep_rate_theta"] == 0.0
    assert res.step_metrics["step_clipfrac"] == 0.0
    assert not alg.after_optimizer_step(res.step_metrics).reset_ewma
    res = step(alg, shifted(prox=0.45, theta=0.1))
    assert res.step_metrics["ti_keep_rate"] == 0.0 and res.step_metrics["ti_keep_rate_theta"] == 1.0
    decision = alg.after_optimizer_step(res.step_metrics)
    assert decision.reset_ewma and decision.metrics["ewma_resets_total"] == 1.0
    assert alg.ewma_age == 0.0 and alg.ewma_weight == 1.0


def test_reset_fires_when_the_clip_starves_the_step():
    alg = build("ppo_ewma", reset_keep_rate=0.0, **ASYNC2)
    res = step(alg, shifted(prox=0.0, theta=0.5))                     # s = e^0.5 > 1.2, A > 0: all clipped
    assert res.step_metrics["step_clipfrac"] == 1.0 and res.grad_logp.abs().max() == 0
    assert alg.after_optimizer_step(res.step_metrics).reset_ewma
    res = step(alg, shifted(prox=0.0, theta=0.1))
    assert res.step_metrics["step_clipfrac"] == 0.0
    assert not alg.after_optimizer_step(res.step_metrics).reset_ewma
    off = build("ppo_ewma", auto_reset=False, **ASYNC2)
    assert not off.after_optimizer_step(step(off, shifted(prox=0.0, theta=0.5)).step_metrics).reset_ewma


def test_age_follows_the_ewma_weights_and_survives_a_resume():
    alg, p = build("ppo_ewma", ewma_beta=0.5), torch.zeros(2)
    ew = EwmaWeights([p], beta=0.5)
    for i, reset in enumerate([False, False, True, False, False]):
        p.fill_(float(i + 1))
        rate = 1.0 if not reset else 0.0
        decision = alg.after_optimizer_step({"ti_keep_rate": rate, "ti_keep_rate_theta": 1.0,
                                             "step_clipfrac": 0.0})
        assert decision.reset_ewma == reset
        ew.reset([p]) if reset else ew.update([p])
        assert alg.ewma_age == pytest.approx(ew.age, abs=1e-12) and alg.ewma_weight == ew.weight
    # reset at weights 3, then 4 and 5 folded in: weights beta^age 0.25, 0.5, 1 on ages 2, 1, 0
    assert ew.shadow[0][0].item() == pytest.approx((0.25 * 3 + 0.5 * 4 + 5) / 1.75)
    assert ew.age == pytest.approx((0.25 * 2 + 0.5 * 1) / 1.75, abs=1e-12)
    restored = build("ppo_ewma", ewma_beta=0.5)
    restored.load_state_dict(alg.state_dict())
    assert restored.num_resets == 1
    assert (restored.ewma_age, restored.ewma_weight) == (alg.ewma_age, alg.ewma_weight)
    with pytest.raises(ValueError, match="unknown state keys"):
        restored.load_state_dict({"bogus": 1})


@pytest.mark.parametrize("source", ["snapshot", "old_logit_model", "interrupt"])
@pytest.mark.parametrize("key,value", [("ewma_beta", 0.5), ("auto_reset", False), ("reset_keep_rate", 0.3),
                                       ("reset_clip_frac", 0.9)])
def test_ewma_keys_with_an_exact_source_are_refused(source, key, value):
    with pytest.raises(ValueError, match=rf"algorithm 'ppo_ewma': {key} set with old_logp_source={source}, "
                                         r"whose exact old logits replace the EWMA proximal policy"):
        build("ppo_ewma", old_logp_source=source, **{key: value})


def test_ewma_route_defaults():
    c = build("ppo_ewma", old_logp_source="rollout").config
    assert (c.ewma_beta, c.auto_reset, c.reset_keep_rate, c.reset_clip_frac) == (0.75, True, 0.5, 0.5)
    with pytest.raises(ValueError, match=r"reset_clip_frac must be in \[0, 1\], got 1.5"):
        build("ppo_ewma", old_logp_source="rollout", reset_clip_frac=1.5)


@pytest.mark.parametrize("objective", ["decoupled", "original"])
def test_recompute_is_refused(objective):
    """Neither route reads recomputed log-probs (exact: pi_old; ewma: pi_prox and pi_infer), so a forward per
    round would be spent on nothing: refused, naming the sources that mean something."""
    with pytest.raises(ValueError, match=r"old_logp_source=recompute computes log-probs its loss never reads .*"
                                         r"use rollout \(EWMA anchor\) or snapshot\|old_logit_model\|interrupt"):
        build("ppo_ewma", old_logp_source="recompute", objective=objective)


def test_exact_route_says_once_when_the_gate_drops_most_tokens(caplog):
    """Engine and trainer disagreeing by more than the gate at the same weights (bf16 rounding): one warning
    naming the bounds that would have kept most tokens, not one per update; a gate that keeps everything says
    nothing."""
    alg = build("ppo_ewma", old_logp_source="snapshot", **ASYNC2)
    with caplog.at_level("WARNING", logger="mcore_rl.algorithms.ppo_ewma"):
        res = step(alg, shifted(old=0.0, theta=0.0))                  # d = 1: kept
        alg.after_optimizer_step(res.step_metrics)
        assert res.step_metrics["ti_keep_rate"] == 1.0 and not caplog.records
        for _ in range(2):
            res = step(alg, shifted(old=0.015, theta=0.015))         # log d = 0.015 > log 1.005: all masked
            alg.after_optimizer_step(res.step_metrics)
    assert res.step_metrics["ti_keep_rate"] == 0.0
    assert [res.step_metrics[f"ti_within_{t}"] for t in ("0.005", "0.01", "0.02", "0.05")] == [0.0, 0.0, 1.0, 1.0]
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "kept 0.00 of the tokens" in msgs[0]
    assert "algorithm.ti_low=0.9802 algorithm.ti_high=1.02 would have kept 1.00" in msgs[0]


def test_noise_floor_shares_are_what_the_gate_would_keep_at_those_bounds(caplog):
    """ti_within_<t> = the keep-rate of a symmetric gate [e^-t, e^t] on the same tokens (random log d per row);
    a disagreement beyond every probe is called what it is, not rounding."""
    ro = make_rollout(seed=3, veto_tokens=0)
    ro.old_logp = ro.rollout_logp + 0.03 * torch.randn(ro.mask.shape, generator=torch.Generator().manual_seed(1),
                                                        dtype=D)
    for t in (0.005, 0.01, 0.02, 0.05):
        probe = build("ppo_ewma", old_logp_source="snapshot", ti_level="token", ti_low=0.0, ti_high=1.0)
        at_t = build("ppo_ewma", old_logp_source="snapshot", ti_level="token", ti_low=math.exp(-t),
                     ti_high=math.exp(t))
        got = run_step(probe, ro).step_metrics[f"ti_within_{t:g}"]
        assert 0.0 < got < 1.0
        assert got == pytest.approx(run_step(at_t, ro).step_metrics["ti_keep_rate"], abs=1e-9)
    alg = build("ppo_ewma", old_logp_source="snapshot", **ASYNC2)
    with caplog.at_level("WARNING", logger="mcore_rl.algorithms.ppo_ewma"):
        alg.after_optimizer_step(step(alg, shifted(old=0.3, theta=0.3)).step_metrics)
    assert "engine and trainer disagree beyond rounding" in caplog.records[0].getMessage()
