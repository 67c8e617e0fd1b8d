"""The 15 numerical cases of ALGORITHMS.md section 7, one test (or a few) each."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mcore_rl.algorithms import (
    CorrectionConfig,
    EwmaWeights,
    TokenBatch,
    aggregate,
    compute_ess,
    correction_weights,
)
from mcore_rl.algorithms.mu_grpo import nav_veto
from mcore_rl.algorithms.scaling_curve import fit_sigmoid, sigmoid_curve
from tests.algorithms.algo_testlib import build, make_rollout, run_step

pytestmark = pytest.mark.algorithms
D = torch.float64


def one_step(alg, logp_vals, anchor_vals, adv_vals, mask_vals=None, weight=None):
    """Loss and dL/dlogp for hand-made [1, T] or [B, T] tensors (anchor = rollout = old = prox)."""
    logp = torch.tensor(logp_vals, dtype=D).reshape(len(adv_vals), -1).requires_grad_(True)
    anchor = torch.tensor(anchor_vals, dtype=D).reshape_as(logp)
    mask = torch.ones_like(anchor) if mask_vals is None else torch.tensor(mask_vals, dtype=D).reshape_as(anchor)
    adv = torch.tensor(adv_vals, dtype=D)[:, None].expand_as(anchor)
    w = mask / mask.sum() if weight is None else weight
    batch = TokenBatch(logp=logp, mask=mask, advantages=adv, rollout_logp=anchor, token_weight=w, old_logp=anchor,
                       prox_logp=anchor)
    loss, metrics = alg.loss(batch)
    loss.backward()
    alg.finish_accumulation()
    return float(loss), logp.grad, metrics


# 1 -------------------------------------------------------------------------------------------------
def test_p3o_on_policy_is_reinforce_with_group_zscores():
    ro = make_rollout(veto_tokens=0)
    ro.rollout_logp = ro.logp.clone()
    alg = build("p3o")
    adv = alg.advantages(ro.rewards, ro.group_ids).advantages.to(D)
    res = run_step(alg, ro, adv=adv)
    n_tok = ro.mask.sum()
    expected = -(adv[:, None] * ro.logp * ro.mask).sum() / n_tok
    assert res.metrics[0]["ess_factor"] == pytest.approx(1.0, abs=1e-8)
    assert res.loss == pytest.approx(float(expected), rel=1e-9)
    assert torch.allclose(res.grad_logp, -adv[:, None] * ro.mask / n_tok, atol=1e-9)


# 2 -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("c,weight", [(2.0, 1.0), (0.5, 0.5)])
def test_p3o_uniform_ratios_give_ess_one(c, weight):
    logp = [-1.0, -2.0, -0.5, -3.0]
    anchor = [v - math.log(c) for v in logp]
    _, grad, m = one_step(build("p3o"), logp, anchor, [1.0])
    assert m["ess_factor"] == pytest.approx(1.0, abs=1e-8)
    # dL/dlogp = w_tok * (-min(w, ESS) * A + (1 - ESS) * (1 - 1/w)); the KL weight is ~0 here
    assert torch.allclose(grad, torch.full_like(grad, -weight / 4), atol=1e-8)


# 3 -------------------------------------------------------------------------------------------------
def test_p3o_two_tokens():
    logp = [-1.0, -1.0 + math.log(3.0)]
    _, grad, m = one_step(build("p3o"), logp, [-1.0, -1.0], [1.0])
    assert m["ess_factor"] == pytest.approx(16 / 20, abs=1e-8)
    # both weights capped at 0.8; the w=3 token also gets the 0.2-weighted k3 gradient 0.2 * (1 - 1/3)
    assert grad[0, 0].item() == pytest.approx(-0.8 / 2, abs=1e-8)
    assert grad[0, 1].item() == pytest.approx((-0.8 + 0.2 * (1 - 1 / 3)) / 2, abs=1e-8)
    assert grad[0, 1].item() != 0.0


# 4 -------------------------------------------------------------------------------------------------
def test_p3o_padding_and_empty_mask():
    logp = torch.tensor([[-1.0, -0.2, -3.0, 5.0, 40.0]], dtype=D)
    beh = torch.tensor([[-1.3, -0.1, -2.0, -30.0, -1.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0]], dtype=D)
    ess_padded = compute_ess(logp, beh, mask)
    ess_trimmed = compute_ess(logp[:, :3], beh[:, :3], mask[:, :3])
    w = torch.exp(logp[0, :3] - beh[0, :3])
    assert ess_padded == pytest.approx(ess_trimmed, abs=1e-15)
    assert ess_padded == pytest.approx(float(w.sum() ** 2 / (3 * (w * w).sum())), rel=1e-7)
    assert compute_ess(logp, beh, torch.zeros_like(mask)) == 1.0


# 5 -------------------------------------------------------------------------------------------------
RHO = [1.0, 0.9, 1e-6, 1.1, 1e-7, 0.8]


@pytest.mark.parametrize("scope,vetoed", [("S_kappa", {3, 4, 5}), ("H_kappa", {3, 5}), ("seq", set(range(6))),
                                          ("trigger", {2, 4})])
def test_nav_scopes(scope, vetoed):
    log_rho = torch.log(torch.tensor([RHO], dtype=D))
    mask = torch.ones_like(log_rho)
    v, trig = nav_veto(log_rho, torch.full_like(log_rho, -1.0), mask, 1e-4, scope)
    assert set(torch.nonzero(trig[0]).flatten().tolist()) == {2, 4}
    assert set(torch.nonzero(v[0]).flatten().tolist()) == vetoed
    # nothing for A >= 0, nor when no ratio is below delta
    for adv in (0.0, 1.0):
        assert not nav_veto(log_rho, torch.full_like(log_rho, adv), mask, 1e-4, scope)[0].any()
    calm = torch.log(torch.tensor([[1.0, 0.9, 0.5, 1.1, 0.01, 0.8]], dtype=D))
    assert not nav_veto(calm, -torch.ones_like(calm), mask, 1e-4, scope)[0].any()


# 6 -------------------------------------------------------------------------------------------------
def test_relaxed_clip_never_clips_negative_advantages():
    rho = torch.tensor([1e-3, 0.3, 1.0, 3.0, 20.0], dtype=D)
    _, grad, m = one_step(build("mu_grpo"), rho.log().tolist(), [0.0] * 5, [-2.0])
    assert m["pg_clipfrac"] == 0.0 and m["nav_vetoed_frac"] == 0.0
    assert torch.allclose(grad[0], 2.0 * rho / 5, rtol=1e-12)     # d(-rho*A)/dlogp = -rho*A, A = -2


def test_relaxed_clip_positive_advantage_above_five():
    loss, grad, m = one_step(build("mu_grpo"), [math.log(6.0)], [0.0], [1.0])
    assert loss == pytest.approx(-5.0, rel=1e-12)
    assert grad.abs().max().item() == 0.0 and m["pg_clipfrac"] == 1.0


# 7 -------------------------------------------------------------------------------------------------
def test_dapo_clip_higher():
    loss, grad, m = one_step(build("dapo"), [math.log(1.25)], [0.0], [1.0])
    assert loss == pytest.approx(-1.25) and grad.item() == pytest.approx(-1.25) and m["pg_clipfrac"] == 0.0
    loss, grad, m = one_step(build("dapo"), [math.log(0.75)], [0.0], [-1.0])
    assert loss == pytest.approx(0.8) and grad.item() == 0.0 and m["pg_clipfrac"] == 1.0


# 8 -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,value", [("token-mean", 1 / 24), ("seq-mean-token-mean", 0.25),
                                        ("prompt-mean", 0.125)])
def test_aggregation_modes(mode, value):
    lens = [1, 3, 10, 10]
    mask = (torch.arange(10)[None, :] < torch.tensor(lens)[:, None]).to(D)
    per_tok = torch.zeros_like(mask)
    per_tok[0, 0] = 1.0
    per_tok[0, 1:] = 123.0          # padding junk must not leak
    got = aggregate(per_tok, mask, torch.tensor([0, 0, 1, 1]), mode)
    assert float(got) == pytest.approx(value, rel=1e-12)


# 9 -------------------------------------------------------------------------------------------------
def test_dr_grpo_advantages_and_length_free_denominator():
    r = torch.tensor([1.0, 0.0, 0.5, 0.0, 2.0, 1.0], dtype=D)
    gid = torch.tensor([0, 0, 0, 1, 1, 1])
    dr, grpo = build("dr_grpo"), build("grpo")
    a = dr.advantages(r, gid).advantages
    assert torch.allclose(dr.advantages(3 * r, gid).advantages, 3 * a, atol=1e-6)
    assert torch.allclose(dr.advantages(r + 5, gid).advantages, a, atol=1e-6)
    g = grpo.advantages(r, gid).advantages
    assert torch.allclose(grpo.advantages(3 * r, gid).advantages, g, atol=1e-5)
    assert torch.allclose(grpo.advantages(r + 5, gid).advantages, g, atol=1e-6)
    mask = (torch.arange(8)[None, :] < torch.tensor([1, 8, 3, 5, 2, 7])[:, None]).to(D)
    w = dr.token_weights(mask, gid)
    assert torch.allclose(w[mask > 0], torch.full_like(w[mask > 0], 1 / (6 * 4096)), rtol=1e-12)


# 10 ------------------------------------------------------------------------------------------------
def test_ewma_sequence_and_reset():
    p = torch.zeros(3)
    ew = EwmaWeights([p], beta=0.5)
    p.fill_(1.0)
    ew.update([p])
    assert ew.shadow[0][0].item() == pytest.approx(2 / 3, abs=1e-6)
    p.fill_(2.0)
    ew.update([p])
    assert ew.shadow[0][0].item() == pytest.approx((0.25 * 0 + 0.5 * 1 + 2) / 1.75, abs=1e-6)
    assert ew.shadow[0][0].item() == pytest.approx(1.428571, abs=1e-6)
    p.fill_(7.0)
    ew.reset([p])
    assert ew.shadow[0].tolist() == [7.0] * 3 and ew.weight == 1.0


# 11 ------------------------------------------------------------------------------------------------
def test_decoupled_with_exact_old_equals_ppo():
    ro = make_rollout(veto_tokens=0)
    ro.prox_logp = ro.rollout_logp.clone()
    ro.old_logp = ro.rollout_logp.clone()
    ewma = build("ppo_ewma", ti_level="token", loss_agg_mode="seq-mean-token-mean")
    ppo = build("grpo", kl_coef=0.0, old_logp_source="recompute")
    a, b = run_step(ewma, ro), run_step(ppo, ro)
    assert a.step_metrics["ti_keep_rate"] == 1.0
    assert a.loss == pytest.approx(b.loss, rel=1e-12)
    assert torch.allclose(a.grad_logp, b.grad_logp, atol=1e-15)


# 12 ------------------------------------------------------------------------------------------------
def test_cispo_keeps_gradient_where_ppo_clips():
    _, grad, m = one_step(build("cispo"), [math.log(7.0)], [0.0], [1.5])
    assert grad.item() == pytest.approx(-5 * 1.5) and m["cispo_trunc_frac"] == 1.0
    _, grad_ppo, _ = one_step(build("grpo", kl_coef=0.0), [math.log(7.0)], [0.0], [1.5])
    assert grad_ppo.item() == 0.0


# 13 ------------------------------------------------------------------------------------------------
def test_tis_and_mis_weights():
    roll = torch.zeros(1, 2, dtype=D)
    train = torch.log(torch.tensor([[0.5, 3.0]], dtype=D))
    mask = torch.ones_like(roll)
    tis = correction_weights(train, roll, mask, CorrectionConfig(mode="tis", tis_max=2.0))
    assert torch.allclose(tis.weight * tis.keep, torch.tensor([[0.5, 2.0]], dtype=D))
    mis = correction_weights(train, roll, mask, CorrectionConfig(mode="mis", low=0.5, high=2.0))
    assert torch.allclose(mis.weight * mis.keep, torch.tensor([[0.5, 0.0]], dtype=D))
    assert float(mis.metrics["rollout_rs_masked_fraction"]) == 0.5


# 14 ------------------------------------------------------------------------------------------------
def test_sigmoid_curve_limits_and_fit():
    a, b, c_mid, r0 = 0.61, 1.7, 3000.0, 0.12
    assert float(sigmoid_curve(c_mid, a, b, c_mid, r0)) == pytest.approx((r0 + a) / 2, abs=1e-12)
    assert float(sigmoid_curve(1e12, a, b, c_mid, r0)) == pytest.approx(a, abs=1e-6)
    assert float(sigmoid_curve(1e-9, a, b, c_mid, r0)) == pytest.approx(r0, abs=1e-6)
    compute = np.geomspace(100, 20000, 25)
    fit = fit_sigmoid(compute, sigmoid_curve(compute, a, b, c_mid, r0), r0)
    assert abs(fit.a - a) < 1e-3 and abs(fit.b - b) < 1e-3 and abs(fit.c_mid - c_mid) / c_mid < 1e-3


# 15 ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "prompt-mean", "seq-mean-token-sum-norm"])
def test_zero_variance_group_changes_no_denominator(mode):
    ro = make_rollout()      # group 0 (ids 3) has all-equal rewards
    alg = build("dapo", loss_agg_mode=mode)
    res = alg.advantages(ro.rewards, ro.group_ids, lengths=torch.zeros(len(ro.rewards)))
    assert res.num_zero_variance_groups == 1
    assert not res.keep[:4].any() and res.keep[4:].all() and (res.advantages[:4] == 0).all()
    w_all = alg.token_weights(ro.mask, ro.group_ids, keep=res.keep)
    w_without = alg.token_weights(ro.mask[4:], ro.group_ids[4:])
    assert (w_all[:4] == 0).all()
    assert torch.allclose(w_all[4:], w_without, rtol=1e-12)
