"""Autograd gradients of every loss equal gradients derived by hand, on a small random batch (float64)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.algorithms.algo_testlib import build, make_rollout, run_step

pytestmark = pytest.mark.algorithms


def ppo_grad(logp, anchor, adv, eps_low, eps_high, dual_c=None):
    """d/dlogp of -min(rA, clip(r)A) (+ dual clip): -rA where the unclipped branch is taken, else 0."""
    r = torch.exp((logp - anchor).clamp(-20, 20))
    l_unc, l_clip = -adv * r, -adv * r.clamp(1 - eps_low, 1 + eps_high)
    g = torch.where(l_unc >= l_clip, -adv * r, torch.zeros_like(r))
    if dual_c is not None:
        g = torch.where((adv < 0) & (torch.maximum(l_unc, l_clip) > -adv * dual_c), torch.zeros_like(g), g)
    return g


def k3_grad(logp, q):
    """d/dlogp of exp(x) - x - 1, x = clamp(q - logp, -10, 10): zero where the clamp is active."""
    x = q - logp
    return torch.where(x.abs() <= 10, 1.0 - torch.exp(x), torch.zeros_like(x))


def setup(name, **kw):
    ro = make_rollout(seed=3)
    alg = build(name, **kw)
    adv_res = alg.advantages(ro.rewards, ro.group_ids, lengths=ro.mask.sum(dim=1))
    w = alg.token_weights(ro.mask, ro.group_ids, keep=adv_res.keep)
    adv = adv_res.advantages.to(torch.float64)[:, None].expand_as(ro.mask)
    return ro, alg, w, adv


def check(alg, ro, expected_logp, expected_ent=None):
    res = run_step(alg, ro, splits=2)
    m = ro.mask > 0
    assert torch.allclose(res.grad_logp[m], expected_logp[m], atol=1e-12, rtol=1e-9)
    assert (res.grad_logp[~m] == 0).all()
    if expected_ent is not None:
        assert torch.allclose(res.grad_entropy, expected_ent, atol=1e-12)
    assert res.grad_logp.abs().sum() > 0
    return res


def test_grpo_with_kl_entropy_and_dual_clip():
    ro, alg, w, adv = setup("grpo", kl_coef=0.05, entropy_coef=0.01, dual_clip_c=3.0)
    g = ppo_grad(ro.logp, ro.old_logp, adv, 0.2, 0.2, 3.0) + 0.05 * k3_grad(ro.logp, ro.ref_logp)
    res = check(alg, ro, w * g, expected_ent=-0.01 * w)
    assert 0 < res.metrics[0]["pg_clipfrac"] < 1


@pytest.mark.parametrize("name,eps_high", [("dapo", 0.28), ("dr_grpo", 0.2)])
def test_presets(name, eps_high):
    ro, alg, w, adv = setup(name)
    check(alg, ro, w * ppo_grad(ro.logp, ro.old_logp, adv, 0.2, eps_high))


def test_bypass_anchor_is_rollout():
    ro, alg, w, adv = setup("grpo", kl_coef=0.0, old_logp_source="rollout")
    check(alg, ro, w * ppo_grad(ro.logp, ro.rollout_logp, adv, 0.2, 0.2))


def test_mu_grpo_veto_and_renormalisation():
    ro, alg, w, adv = setup("mu_grpo")
    log_r = (ro.logp - ro.rollout_logp).clamp(-20, 20)
    trig = (log_r < math.log(1e-4)) & (ro.mask > 0) & (adv < 0)
    after = (trig.cumsum(1) - trig.long()) > 0                  # S_kappa
    keep = (~(after & (adv < 0))).to(torch.float64) * ro.mask
    assert (keep[ro.mask > 0] == 0).any()
    scale = (w * ro.mask).sum() / (w * keep).sum()              # vetoed tokens leave the denominator
    g = ppo_grad(ro.logp, ro.rollout_logp, adv, 1.0, 4.0)
    res = check(alg, ro, w * keep * g * scale)
    assert res.step_metrics["grad_scale"] == pytest.approx(float(scale), rel=1e-12)
    # token-mean: the result is exactly sum(m' l) / sum(m')
    assert torch.allclose(w * keep * scale, keep / keep.sum(), atol=1e-15)


def test_p3o():
    ro, alg, w, adv = setup("p3o")
    lw = torch.where(ro.mask > 0, (ro.logp - ro.rollout_logp).clamp(-20, 20), torch.zeros_like(ro.logp))
    ratio = torch.exp(lw)
    m = ro.mask
    ess = float((ratio * m).sum() ** 2 / (m.sum() * (ratio ** 2 * m).sum() + 1e-8))
    g = -ratio.clamp(max=ess) * adv + (1 - ess) * k3_grad(ro.logp, ro.rollout_logp)
    alg_one = build("p3o")                                      # one micro-batch: ESS over the whole batch
    res = run_step(alg_one, ro, splits=1)
    assert res.metrics[0]["ess_factor"] == pytest.approx(ess, rel=1e-12)
    assert torch.allclose(res.grad_logp[m > 0], (w * g)[m > 0], atol=1e-12, rtol=1e-9)


@pytest.mark.parametrize("tis", [None, 1.5])
def test_ppo_ewma_decoupled(tis):
    # on-policy, fresh EWMA (age 0, lag 0): the plain TI bounds (tests/algorithms/test_ppo_ewma.py: the widening)
    ro, alg, w, adv = setup("ppo_ewma", ti_level="token", ti_low=0.8, ti_high=1.25, ti_tis_max=tis,
                            updates_per_rollout=1)
    d = torch.exp((ro.prox_logp - ro.rollout_logp).clamp(-20, 20))
    keep = ((d >= 0.8) & (d <= 1.25)).to(torch.float64)
    assert 0 < keep[ro.mask > 0].mean() < 1
    g = ppo_grad(ro.logp, ro.prox_logp, adv, 0.2, 0.2) * keep
    if tis is not None:
        g = g * d.clamp(max=tis)
    check(alg, ro, w * g)


def test_ppo_ewma_original_objective():
    ro, alg, w, adv = setup("ppo_ewma", objective="original", imp_samp_max=3.0)
    log_behav = torch.maximum(ro.rollout_logp, ro.logp - math.log(3.0))
    weight = torch.exp(ro.prox_logp - log_behav)
    check(alg, ro, w * weight * ppo_grad(ro.logp, ro.prox_logp, adv, 0.2, 0.2))


@pytest.mark.parametrize("name", ["cispo", "scalerl"])
def test_cispo(name):
    ro, alg, w, adv = setup(name)
    rho = torch.exp((ro.logp - ro.rollout_logp).clamp(-20, 20))
    assert (rho[ro.mask > 0] > 5).any()
    res = check(alg, ro, w * (-rho.clamp(0, 5) * adv))
    assert res.step_metrics["cispo_trunc_frac"] > 0


@pytest.mark.parametrize("mode,level,ratio", [("tis", "token", "old"), ("mis", "geometric", "old"),
                                              ("rs", "sequence", "current"), ("tis", "token", "current")])
def test_correction_on_grpo(mode, level, ratio):
    corr = {"mode": mode, "level": level, "low": 0.7, "high": 1.3, "tis_max": 1.1, "veto_threshold": 1e-3,
            "ratio": ratio}
    ro, alg, w, adv = setup("grpo", kl_coef=0.0, correction=corr)
    m = ro.mask
    train = ro.old_logp if ratio == "old" else ro.logp
    lw = torch.where(m > 0, (train - ro.rollout_logp).clamp(-20, 20), torch.zeros_like(m))
    if level == "sequence":
        lw_l = lw.sum(1, keepdim=True).clamp(-20, 20).expand_as(lw)
    elif level == "geometric":
        lw_l = (lw.sum(1, keepdim=True) / m.sum(1, keepdim=True)).expand_as(lw)
    else:
        lw_l = lw
    wt = torch.exp(lw_l)
    inside = ((wt >= 0.7) & (wt <= 1.3)).to(torch.float64)
    weight = {"tis": wt.clamp(0, 1.1), "mis": wt * inside, "rs": inside}[mode]
    vetoed = ((lw < math.log(1e-3)) & (m > 0)).any(1, keepdim=True)
    assert vetoed.any() == (ratio == "current")
    weight = weight * (~vetoed).to(torch.float64)
    check(alg, ro, w * weight * ppo_grad(ro.logp, ro.old_logp, adv, 0.2, 0.2))
