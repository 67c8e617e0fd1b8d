"""experiments/stats.py: the crossed (seeds x prompts) bootstrap behind every interval in experiments/*/results.md."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))

from stats import TargetTimes, bootstrap_interval, curve, difference_interval, time_to_target  # noqa: E402


def _crossed(rng: np.random.Generator, n_s: int, n_p: int, mu: float = 0.4) -> np.ndarray:
    """mu + seed effect + prompt effect + noise: the mean over the population of seeds and prompts is mu."""
    return mu + rng.normal(0, 0.05, (n_s, 1)) + rng.normal(0, 0.15, (1, n_p)) + rng.normal(0, 0.1, (n_s, n_p))


def _coverage(n_s: int, n_p: int, trials: int = 300) -> float:
    rng = np.random.default_rng(123)
    hits = 0
    for t in range(trials):
        iv = bootstrap_interval(_crossed(rng, n_s, n_p), reps=1000, seed=t)
        hits += iv.lo <= 0.4 <= iv.hi
    return hits / trials


def test_coverage_near_nominal_with_enough_seeds():
    # 10 seeds x 40 prompts: the crossed bootstrap covers the true mean at about 95% (it is mildly conservative)
    cov = _coverage(10, 40)
    assert 0.90 <= cov <= 0.995, cov


def test_coverage_with_three_seeds_is_below_nominal():
    # the documented limit: 3 seeds give 10 distinct seed resamples; the interval is too narrow, not too wide
    cov = _coverage(3, 40)
    assert 0.6 <= cov < 0.95, cov


def test_prompts_alone_when_one_seed():
    # one seed: only the prompt resampling is left; the interval equals the prompt-bootstrap of that row
    row = np.r_[np.ones(16), np.zeros(48)]  # 25% correct on 64 prompts
    iv = bootstrap_interval(row[None, :], reps=4000, seed=0)
    assert iv.mean == pytest.approx(0.25)
    se = np.sqrt(0.25 * 0.75 / 64)
    assert iv.lo == pytest.approx(0.25 - 1.96 * se, abs=0.02)
    assert iv.hi == pytest.approx(0.25 + 1.96 * se, abs=0.02)
    assert iv.n_seeds == 1 and iv.n_prompts == 64


def test_deterministic_given_seed_and_seed_matters():
    data = _crossed(np.random.default_rng(0), 3, 32)
    a, b = bootstrap_interval(data, seed=7), bootstrap_interval(data, seed=7)
    assert a == b
    c = bootstrap_interval(data, seed=8)
    assert (c.lo, c.hi) != (a.lo, a.hi)
    assert a.lo < a.mean < a.hi


def test_seeds_only_fallback_and_cell():
    iv = bootstrap_interval([0.30, 0.35, 0.40], seed=0)
    assert iv.n_prompts == 0 and iv.mean == pytest.approx(0.35)
    assert 0.30 - 1e-9 <= iv.lo < 0.35 < iv.hi <= 0.40 + 1e-9
    assert iv.cell() == f"0.350 [{iv.lo:.3f}, {iv.hi:.3f}]"
    assert bootstrap_interval([0.5]).cell() == "0.500"


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="scores"):
        bootstrap_interval(np.zeros((2, 2, 2)))
    with pytest.raises(ValueError, match="scores"):
        bootstrap_interval([float("nan"), 0.1])
    with pytest.raises(ValueError, match="level"):
        bootstrap_interval([0.1, 0.2], level=1.5)


def test_difference_interval_separates_a_real_gap():
    rng = np.random.default_rng(1)
    prompts = rng.normal(0, 0.15, (1, 48))
    a = 0.50 + prompts + rng.normal(0, 0.03, (5, 1)) + rng.normal(0, 0.05, (5, 48))
    b = 0.40 + prompts + rng.normal(0, 0.03, (5, 1)) + rng.normal(0, 0.05, (5, 48))
    d = difference_interval(a, b, seed=0)
    assert d.lo > 0.03 and d.hi < 0.17 and d.mean == pytest.approx(a.mean() - b.mean())
    # shared prompts are resampled jointly: the prompt effect cancels, so the gap's interval is narrower than
    # the gap between the two arms' separate intervals would suggest
    ia = bootstrap_interval(a)
    assert d.hi - d.lo < ia.hi - ia.lo
    with pytest.raises(ValueError, match="same prompts"):
        difference_interval(a, b[:, :10])


def test_curve_uses_steps_every_seed_reached():
    def rec(step, wall, correct):
        return {"step": step, "wallclock_s": wall, "correct": correct, "mean_at_k": float(np.mean(correct))}

    per_seed = {
        1: [rec(0, 0, [0, 0.5]), rec(4, 100, [1, 0.5]), rec(8, 200, [1, 1])],
        2: [rec(0, 0, [0, 0.25]), rec(4, 120, [0.5, 0.5])],
    }  # seed 2 was interrupted after step 4
    pts = curve(per_seed, x_key="wallclock_s")
    assert [x for x, _ in pts] == [0.0, 110.0]
    assert pts[1][1].mean == pytest.approx(0.625) and pts[1][1].n_seeds == 2 and pts[1][1].n_prompts == 2


def _arm(points: list[tuple[int, float, float]], n_p: int = 8, seeds: int = 3, noise: float = 0.0, rng=None):
    """Eval records per seed at (step, wall-clock, accuracy); every prompt scores the accuracy, plus noise."""
    out = {}
    for s in range(seeds):
        recs = []
        for step, wall, acc in points:
            c = np.full(n_p, acc) + (rng.normal(0, noise, n_p) if noise else 0.0)
            recs.append({"step": step, "wallclock_s": wall * (1 + 0.01 * s), "correct": c.tolist()})
        out[1234 + s] = recs
    return out


def test_time_to_target_interpolates_between_sparse_eval_points():
    # A: 0.2 -> 0.6 over 100 s, evaluated every 50 s; B: 0.2 -> 0.4 over 200 s, evaluated every 100 s.
    a = _arm([(0, 0, 0.2), (6, 50, 0.4), (12, 100, 0.6)], seeds=1)
    b = _arm([(0, 0, 0.2), (4, 100, 0.3), (8, 200, 0.4)], seeds=1)
    half, full = time_to_target([a, b], 0.5), time_to_target([a, b], 1.0)
    assert half.target == pytest.approx(0.3) and full.target == pytest.approx(0.4)
    # 'first eval point at or above' would say A: 50 s for both targets; the interpolated crossing is 25 s / 50 s.
    assert [t.time for t in half.times] == pytest.approx([25.0, 100.0])
    assert [t.time for t in full.times] == pytest.approx([50.0, 200.0])
    assert full.ratio(0, 1).time == pytest.approx(0.25)
    # identical prompts and one seed: nothing to resample, the interval is the point
    assert (full.times[0].lo, full.times[0].hi) == pytest.approx((50.0, 50.0))


def test_time_to_target_interval_covers_the_point_and_separates_a_real_speedup():
    rng = np.random.default_rng(0)
    fast = _arm([(0, 0, 0.2), (6, 60, 0.45), (12, 120, 0.55), (18, 180, 0.6)], n_p=32, noise=0.15, rng=rng)
    slow = _arm([(0, 0, 0.2), (6, 120, 0.35), (12, 240, 0.5), (18, 360, 0.6)], n_p=32, noise=0.15, rng=rng)
    res = time_to_target([fast, slow], 0.5)
    for t in res.times:
        assert t.lo <= t.time <= t.hi and np.isfinite(t.hi)
    r = res.ratio(0, 1)
    assert r.lo <= r.time <= r.hi < 1.0  # fast reaches the target in well under slow's time
    assert time_to_target([fast, slow], 0.5).ratio(0, 1) == r  # deterministic given the seed
    again = time_to_target([slow, fast], 0.5).ratio(1, 0)
    assert again.time == pytest.approx(r.time)


def test_time_to_target_refuses_bad_input():
    a = _arm([(0, 0, 0.2), (4, 10, 0.5)])
    with pytest.raises(ValueError, match="fraction"):
        time_to_target([a], 0.0)
    with pytest.raises(ValueError, match="prompt counts"):
        time_to_target([a, _arm([(0, 0, 0.2), (4, 10, 0.5)], n_p=4)], 0.5)


def test_ratio_leaves_out_replicates_without_one():
    """Both curves at the target from the first eval (0 / 0: FLOPs are 0 there) is no ratio, not a NaN bound."""
    reps = np.array([[0.0, 0.0], [1.0, 2.0], [3.0, 4.0], [2.0, 2.0]])
    res = TargetTimes(0.3, [], reps, np.array([1.0, 2.0]), 0.95)
    r = res.ratio(0, 1)
    assert r.time == 0.5 and 0.5 <= r.lo < r.hi <= 1.0
    empty = TargetTimes(0.3, [], reps[:1], np.array([0.0, 0.0]), 0.95).ratio(0, 1)
    assert np.isnan(empty.time) and np.isnan(empty.lo)
