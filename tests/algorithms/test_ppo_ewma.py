"""PPO-EWMA's two routes (exact pi_old vs EWMA proximal), its staleness-aware gate, the gate's bounds calibrated
on the measured engine/trainer disagreement, the reset rule and the configurations it refuses."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_rl.algorithms import EwmaWeights, identity_reduce
from mcore_rl.algorithms.correction import LEVELS
from mcore_rl.algorithms.reduce import global_abs_quantiles
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
    alg = build("ppo_ewma", old_logp_source="snapshot", ti_bounds="fixed", **ASYNC2)
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


# ---- the Train-Infer gate's bounds: calibrated (ti_bounds=auto) or fixed --------------------------------------------
def update(alg, ro, splits: int = 1, reduce=identity_reduce, adv: float | None = None):
    """One update as the trainer drives it: the whole-batch hook on the anchors, then the micro-batches."""
    alg.begin_update(ro.old_logp, ro.prox_logp if alg.needs_prox_logp else None, ro.rollout_logp, ro.mask, reduce)
    a = None if adv is None else torch.full((ro.mask.shape[0],), adv, dtype=D)
    return run_step(alg, ro, splits, reduce, a)


def noisy(rows: int = 20, t: int = 20, scale: float = 0.03, bad: float = 0.5) -> tuple[Rollout, torch.Tensor]:
    """Old log-probs = the engine's + log d: noise scale * N(0, 1) on 95% of the tokens, +-`bad` on every 20th
    (abnormal); theta = old (s = 1). Returns the rollout and the abnormal tokens."""
    g = torch.Generator().manual_seed(0)
    infer = -1.0 - torch.rand(rows, t, generator=g, dtype=D)
    log_d = scale * torch.randn(rows, t, generator=g, dtype=D)
    abnormal = (torch.arange(rows * t) % 20 == 7).reshape(rows, t)
    log_d[abnormal] = bad * torch.sign(torch.randn(int(abnormal.sum()), generator=g, dtype=D))
    old = infer + log_d
    return Rollout(torch.arange(rows, dtype=D), torch.arange(rows) // 2, torch.ones(rows, t, dtype=D), old, infer,
                   old, old, infer, torch.zeros(rows, t, dtype=D)), abnormal


def test_quantiles_of_the_whole_batch_to_one_grid_step():
    x = 0.03 * torch.randn(5000, generator=torch.Generator().manual_seed(2), dtype=D)
    got = global_abs_quantiles(x, torch.ones_like(x), (0.5, 0.9))
    for q, v in zip((0.5, 0.9), got):
        want = float(x.abs().sort().values[math.ceil(q * x.numel()) - 1])  # the smallest value a share q lies within
        assert want <= v <= want * 1.01
    z = torch.tensor([0.0, 0.0, 0.0, 0.2])
    assert global_abs_quantiles(z, torch.ones(4), (0.5, 0.75, 0.9)) == [0.0, 0.0, pytest.approx(0.2, rel=0.01)]
    assert global_abs_quantiles(z, torch.zeros(4), (0.5,)) == [0.0]  # nothing counted


def test_auto_gate_keeps_the_noise_and_drops_the_abnormal_tokens():
    """95% of the tokens disagree by bf16-like noise (0.03), 5% by 0.5. Hand computation: the 0.9 quantile of
    |log d| (the noise's 0.947 quantile) times ti_auto_k = 3 is the half-width; every noise token lies within it and
    no abnormal one does. The paper's fixed [0.995, 1.005] keeps only the noise tokens within +-0.005."""
    ro, abnormal = noisy()
    log_d = ro.old_logp - ro.rollout_logp
    d = log_d.abs().flatten().sort().values
    q90, median = float(d[math.ceil(0.9 * d.numel()) - 1]), float(d[d.numel() // 2 - 1])
    res = update(build("ppo_ewma", old_logp_source="snapshot", ti_level="token"), ro, adv=1.0)
    m = res.step_metrics
    assert q90 <= m["ti_noise_quantile"] <= 1.01 * q90 and median <= m["ti_noise_median"] <= 1.01 * median
    assert m["ti_bound"] == pytest.approx(3 * m["ti_noise_quantile"], rel=1e-12)
    assert float(log_d[~abnormal].abs().max()) < m["ti_bound"] < 0.5
    assert m["ti_keep_rate"] == pytest.approx(0.95, abs=1e-12)
    assert (res.grad_logp[abnormal] == 0).all() and (res.grad_logp[~abnormal] != 0).all()
    fixed = update(build("ppo_ewma", old_logp_source="snapshot", ti_level="token", ti_bounds="fixed"), ro)
    kept = (log_d >= math.log(0.995)) & (log_d <= math.log(1.005))
    assert fixed.step_metrics["ti_keep_rate"] == pytest.approx(float(kept.double().mean()), abs=1e-12)
    assert fixed.step_metrics["ti_keep_rate"] < 0.2 and "ti_bound" not in fixed.step_metrics
    assert fixed.step_metrics["ti_noise_quantile"] == m["ti_noise_quantile"]  # measured all the same


@pytest.mark.parametrize("level", LEVELS)
def test_calibrated_gate_is_split_invariant(level):
    """The bound comes from the whole batch before the first micro-batch: 4 micro-batches give the one-batch
    update, and two DP ranks with half the rows each (a SUM all-reduce, emulated: each rank's reducer adds the
    other's local counts) get the whole batch's bound."""
    ro = make_rollout(seed=13, veto_tokens=0)
    kw = {"old_logp_source": "snapshot", "ti_level": level}
    one, four = update(build("ppo_ewma", **kw), ro), update(build("ppo_ewma", **kw), ro, splits=4)
    assert float((one.grad_logp - four.grad_logp).abs().max()) < 1e-12 and one.grad_logp.abs().max() > 0
    assert one.step_metrics == pytest.approx(four.step_metrics, abs=1e-12)
    assert one.step_metrics["ti_bound"] > math.log(1.005)  # calibrated wider than the fixed bounds
    whole = build("ppo_ewma", **kw)
    whole.begin_update(ro.old_logp, None, ro.rollout_logp, ro.mask)
    halves = [ro.rows(slice(0, 8)), ro.rows(slice(8, None))]  # whole groups of 4 on each rank
    local: list[torch.Tensor] = []  # each rank's own counts, as it hands them to the all-reduce
    for h in halves:
        build("ppo_ewma", **kw).begin_update(h.old_logp, None, h.rollout_logp, h.mask, lambda x: local.append(x) or x)
    for rank, h in enumerate(halves):
        alg = build("ppo_ewma", **kw)
        alg.begin_update(h.old_logp, None, h.rollout_logp, h.mask, lambda x, o=local[1 - rank]: x + o)
        assert alg._calibration == whole._calibration


def test_a_disagreement_beyond_the_cap_is_gated_at_the_cap_and_said(caplog):
    """Every token off by 0.3 at the same weights is not rounding: the half-width stops at ti_auto_max, the gate
    drops them, and the one warning says the cap held. A higher cap admits them."""
    ro = shifted(old=0.3, theta=0.3)
    alg = build("ppo_ewma", old_logp_source="snapshot", **ASYNC2)
    with caplog.at_level("WARNING", logger="mcore_rl.algorithms.ppo_ewma"):
        for _ in range(2):
            res = update(alg, ro)
            alg.after_optimizer_step(res.step_metrics)
    m = res.step_metrics
    assert m["ti_bound"] == 0.2 and m["ti_keep_rate"] == 0.0
    assert m["ti_noise_quantile"] == pytest.approx(0.3, rel=0.01) and m["ti_noise_median"] == m["ti_noise_quantile"]
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "auto gate |log d| <= 0.2" in msgs[0]
    assert "the cap held: engine and trainer disagree beyond rounding" in msgs[0]
    wide = update(build("ppo_ewma", old_logp_source="snapshot", ti_auto_max=1.0), ro).step_metrics
    assert wide["ti_keep_rate"] == 1.0 and wide["ti_bound"] == pytest.approx(0.9, rel=0.01)


def test_fixed_bounds_measure_the_noise_and_a_calibration_lasts_one_update():
    """ti_bounds=fixed logs the measured disagreement but gates with [ti_low, ti_high]; under auto the calibration
    is the update's own: an update without the hook (or with no anchor) gates with the fixed bounds."""
    ro = shifted(old=0.015, theta=0.015)                              # log d = 0.015 on every token
    fixed = update(build("ppo_ewma", old_logp_source="snapshot", ti_bounds="fixed"), ro).step_metrics
    assert fixed["ti_keep_rate"] == 0.0 and "ti_bound" not in fixed
    assert fixed["ti_noise_median"] == pytest.approx(0.015, rel=0.01)
    alg = build("ppo_ewma", old_logp_source="snapshot")
    assert update(alg, ro).step_metrics["ti_keep_rate"] == 1.0
    plain = step(alg, ro).step_metrics                               # no begin_update this time
    assert plain["ti_keep_rate"] == 0.0 and "ti_bound" not in plain and "ti_noise_median" not in plain
    assert alg.begin_update(None, None, ro.rollout_logp, ro.mask) == {}  # old_logp from the update's own forward
    assert step(alg, ro).step_metrics["ti_keep_rate"] == 0.0


def test_ewma_route_calibrates_only_where_d_is_measured_at_equal_versions():
    """On the ewma route d = pi_prox / pi_infer; only with a + L = 0 (sync, one update per rollout, fresh or just
    reset EWMA) does it compare engine and trainer at the same weights. Elsewhere the fixed TI bounds, widened by
    the staleness the clip allows, as before."""
    ro = shifted(prox=0.015, theta=0.015)
    sync1 = build("ppo_ewma", updates_per_rollout=1)                  # L = 0, age 0
    res = update(sync1, ro)
    assert res.step_metrics["ti_keep_rate"] == 1.0 and res.step_metrics["ti_keep_rate_theta"] == 1.0
    assert res.step_metrics["ti_bound"] == pytest.approx(0.045, rel=0.01)
    assert not sync1.after_optimizer_step(res.step_metrics).reset_ewma  # age 0.75 / 1.75: theta_bar trails theta
    a = sync1.ewma_age
    edge = math.log(1.005) + a * math.log(1.2)                        # the widened fixed gate's upper edge
    beyond = update(sync1, shifted(prox=edge + 1e-3, theta=0.0)).step_metrics
    assert beyond["ti_keep_rate"] == 0.0 and "ti_bound" not in beyond and "ti_noise_median" not in beyond
    assert update(sync1, shifted(prox=edge - 1e-3, theta=0.0)).step_metrics["ti_keep_rate"] == 1.0
    assert sync1.after_optimizer_step({"ti_keep_rate": 1.0, "step_clipfrac": 1.0}).reset_ewma  # starved: reset
    assert sync1.ewma_age == 0.0 and "ti_bound" in update(sync1, ro).step_metrics
    stale = build("ppo_ewma", **ASYNC2)                               # L = 2: never at equal versions
    assert "ti_bound" not in update(stale, ro).step_metrics


def test_sequence_level_calibrates_per_token_and_scales_by_length():
    """At ti_level=sequence log d sums the response's tokens: the half-width is measured on the per-token means and
    gates each row's sum at +-w x its length, so it keeps the rows the geometric level keeps."""
    ro = shifted(rows=4, t=6)
    lengths, per_token = [6, 3, 6, 1], [0.01, -0.01, 0.012, 0.3]      # one short row far off
    for i, (n, c) in enumerate(zip(lengths, per_token)):
        ro.mask[i, n:] = 0.0
        ro.old_logp[i] = ro.rollout_logp[i] + c
        ro.logp[i] = ro.old_logp[i]
    # 16 tokens: 9 at 0.01, 6 at 0.012, 1 at 0.3 -> the 0.9 quantile is 0.012, w = 0.036
    geo = update(build("ppo_ewma", old_logp_source="snapshot"), ro).step_metrics
    seq = update(build("ppo_ewma", old_logp_source="snapshot", ti_level="sequence"), ro).step_metrics
    assert geo["ti_bound"] == seq["ti_bound"] == pytest.approx(0.036, rel=0.01)
    assert geo["ti_keep_rate"] == seq["ti_keep_rate"] == pytest.approx(15 / 16, abs=1e-12)
    fixed = update(build("ppo_ewma", old_logp_source="snapshot", ti_level="sequence", ti_bounds="fixed"), ro)
    assert fixed.step_metrics["ti_keep_rate"] == 0.0                  # sums 0.06, -0.03, 0.072, 0.3


@pytest.mark.parametrize("key,value,says", [
    ("ti_bounds", "tight", r"ti_bounds='tight' is not one of \['auto', 'fixed'\]"),
    ("ti_auto_quantile", 1.0, r"ti_auto_quantile must be in \(0, 1\), got 1.0"),
    ("ti_auto_k", 0.5, r"ti_auto_k must be finite and >= 1 .*got 0.5"),
    ("ti_auto_max", 0.0, r"ti_auto_max must be finite and > 0, got 0.0"),
])
def test_bad_gate_bound_keys_are_refused(key, value, says):
    with pytest.raises(ValueError, match=rf"^algorithm 'ppo_ewma': {says}"):
        build("ppo_ewma", old_logp_source="snapshot", **{key: value})
