"""Mu-GRPO's veto activity probes: they count what the loss acts on, and without triggers every scope is one loss.

Why this matters: the experiments ablate the veto's scope; an ablation can only differ from the default where a
trigger fired, so the trigger fraction (and how close ratios came to the threshold) is logged per step."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.algorithms.mu_grpo import NAV_SCOPES, RHO_PROBES
from tests.algorithms.algo_testlib import build, make_rollout, run_step

pytestmark = pytest.mark.algorithms


def _direct(ro, alg) -> tuple[float, dict[float, float]]:
    """Trigger fraction over all tokens and the probes' shares of A < 0 tokens, computed here from the rollout."""
    adv = alg.advantages(ro.rewards, ro.group_ids, lambda x: x, lengths=ro.mask.sum(dim=1)).advantages
    neg = (ro.mask > 0) & (adv[:, None] < 0)
    rho = torch.exp(ro.logp - ro.rollout_logp)
    trig = float((neg & (rho < 1e-4)).sum()) / float(ro.mask.sum())
    return trig, {p: float((neg & (rho < p)).sum()) / float(neg.sum()) for p in RHO_PROBES}


@pytest.mark.parametrize("splits", [1, 3])
def test_trigger_and_ratio_probes_count_the_negative_advantage_tokens(splits):
    ro = make_rollout(seed=3, veto_tokens=5)
    alg = build("mu_grpo")
    got = run_step(alg, ro, splits).step_metrics
    trig, below = _direct(ro, build("mu_grpo"))
    assert trig > 0 and got["nav_trigger_frac"] == pytest.approx(trig, abs=1e-12)
    for p in RHO_PROBES:
        assert got[f"nav_rho_below_{p:g}"] == pytest.approx(below[p], abs=1e-12)
    shares = [got[f"nav_rho_below_{p:g}"] for p in RHO_PROBES]
    assert shares == sorted(shares, reverse=True) and shares[0] > shares[-1]


def test_without_triggers_every_scope_and_veto_off_are_the_same_loss():
    ro = make_rollout(seed=4, veto_tokens=0)
    runs = {s: run_step(build("mu_grpo", nav_scope=s), ro, 2) for s in NAV_SCOPES}
    assert runs["none"].step_metrics["nav_trigger_frac"] == 0.0
    for s, r in runs.items():
        assert r.step_metrics["nav_vetoed_frac"] == 0.0, s
        assert torch.equal(r.grad_logp, runs["none"].grad_logp), s
    # with triggers the scopes do differ: the probe is what tells an ablation that can matter from one that cannot
    ro = make_rollout(seed=4, veto_tokens=6)
    seq, s_kappa = (run_step(build("mu_grpo", nav_scope=s), ro, 2) for s in ("seq", "S_kappa"))
    assert seq.step_metrics["nav_trigger_frac"] > 0
    assert not torch.equal(seq.grad_logp, s_kappa.grad_logp)
