"""ScaleRL sigmoid fits: interval coverage on synthetic noisy curves, and the CLI on run-dir-shaped files."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from mcore_rl.algorithms.scaling_curve import sigmoid_curve
from mcore_rl.evaluation.scaling import FitError, bootstrap_fit
from mcore_rl.metrics_log import MetricsLogger
from tests.evaluation.conftest import run_module

pytestmark = pytest.mark.evaluation

TRUE = dict(a=0.62, b=1.4, c_mid=300.0, r0=0.12)


def _noisy(c: np.ndarray, seed: int, noise: float = 0.02) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return sigmoid_curve(c, TRUE["a"], TRUE["b"], TRUE["c_mid"], TRUE["r0"]) + rng.normal(0, noise, c.size)


def test_bootstrap_intervals_cover_true_parameters_in_90_of_100_trials():
    c = np.geomspace(20, 5000, 16)
    t0 = time.perf_counter()
    joint, per = 0, np.zeros(3)
    for seed in range(100):
        f = bootstrap_fit(c, _noisy(c, seed), TRUE["r0"], num_boot=200, seed=seed)
        hit = np.array([f.a.contains(TRUE["a"]), f.b.contains(TRUE["b"]), f.c_mid.contains(TRUE["c_mid"])])
        per += hit
        joint += bool(hit.all())
        assert f.a.lo < f.a.value < f.a.hi and f.c_mid.lo < f.c_mid.value < f.c_mid.hi
    elapsed = time.perf_counter() - t0
    print(f"joint coverage {joint}/100, per parameter (A, B, C_mid) {per.tolist()}, {elapsed:.1f}s")
    assert joint >= 90, (joint, per)
    # not trivially wide: the intervals of a typical trial are a fraction of the values
    f = bootstrap_fit(c, _noisy(c, 0), TRUE["r0"], num_boot=200)
    assert f.a.hi - f.a.lo < 0.2 and f.c_mid.hi / f.c_mid.lo < 3.0


def test_too_few_points_and_flat_curve_are_one_line_errors():
    with pytest.raises(FitError, match="3 eval point.*need >= 4"):
        bootstrap_fit(np.array([1.0, 2.0, 3.0]), np.array([0.1, 0.2, 0.3]), 0.0, name="runX")
    with pytest.raises(FitError, match="never moves"):
        bootstrap_fit(np.arange(1.0, 7.0), np.zeros(6), 0.0, name="runY")


def _write_run(run_dir, steps, values, seconds_per_step=30.0, flops_per_step=None) -> None:
    """An eval.jsonl written by the trainer's own MetricsLogger (what a real run directory holds)."""
    logger = MetricsLogger(run_dir, {"tensorboard": False})
    for s, v in zip(steps, values):
        rec = {"mean_at_k": float(v), "pass_at_k": float(min(1.0, 2 * v)), "k": 4.0, "num_prompts": 32.0,
               "wallclock_s": s * seconds_per_step}
        if flops_per_step is not None:
            rec["flops"] = s * flops_per_step
        logger.log(int(s), rec, kind="eval")
    logger.close()


def test_cli_fits_run_dirs_extrapolates_and_scores_held_out_points(tmp_path, scaling_inproc):
    steps = np.array([0, 5, 10, 20, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960])
    good, other = tmp_path / "grpo", tmp_path / "mu_grpo"
    _write_run(good, steps, np.r_[TRUE["r0"], _noisy(steps[1:].astype(float), 1, 0.01)], flops_per_step=1e15)
    _write_run(other, steps, np.r_[TRUE["r0"], _noisy(steps[1:] * 2.0, 2, 0.01)], flops_per_step=1e15)
    png, js = tmp_path / "fit.png", tmp_path / "fit.json"
    proc = scaling_inproc("fit", str(good), str(other), "--x", "updates", "--fit-until", "300", "--extrapolate", "2000",
                "--out", str(png), "--json", str(js))
    assert proc.returncode == 0, proc.stderr
    assert "grpo: 9 points fitted" in proc.stdout and "mu_grpo: 9 points fitted" in proc.stdout
    assert "held-out: 4 points" in proc.stdout and "R(2000)" in proc.stdout
    rows = {r["run"]: r for r in json.loads(js.read_text())}
    g = rows["grpo"]
    assert g["A"]["lo"] <= TRUE["a"] <= g["A"]["hi"]
    assert g["C_mid"]["lo"] <= TRUE["c_mid"] <= g["C_mid"]["hi"]
    # the second run reaches the same accuracy with half the updates: its C_mid is about half
    assert rows["mu_grpo"]["C_mid"]["value"] == pytest.approx(TRUE["c_mid"] / 2, rel=0.35)
    held = g["held_out"]
    assert len(held) == 4 and max(abs(h["predicted"] - h["measured"]) for h in held) < 0.06
    assert png.stat().st_size > 5000
    # the other x axes read the accounting fields: same curve, x scaled by 1e15 FLOPs / 30 s per update
    proc = scaling_inproc("fit", str(good), "--x", "flops", "--out", str(tmp_path / "f.png"), "--json", str(js))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(js.read_text())[0]["C_mid"]["value"] == pytest.approx(g["C_mid"]["value"] * 1e15, rel=0.2)
    proc = scaling_inproc("fit", str(good), "--x", "hours", "--out", str(tmp_path / "h.png"), "--json", str(js))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(js.read_text())[0]["C_mid"]["value"] == pytest.approx(g["C_mid"]["value"] / 120, rel=0.2)


def test_cli_errors_name_the_run_and_other_runs_still_fit(tmp_path, scaling_inproc):
    good, short, old = tmp_path / "good", tmp_path / "short", tmp_path / "old"
    steps = np.array([0, 10, 20, 40, 80, 160, 320, 640])
    _write_run(good, steps, np.r_[TRUE["r0"], _noisy(steps[1:].astype(float), 3, 0.01)])
    _write_run(short, [0, 10, 20], [0.1, 0.2, 0.3])
    _write_run(old, steps, np.r_[TRUE["r0"], _noisy(steps[1:].astype(float), 4, 0.01)])  # no flops field
    missing = tmp_path / "nope"
    proc = run_module("mcore_rl.evaluation.scaling_cli", "fit", str(good), str(short), str(missing), "--out",
                      str(tmp_path / "p.png"), timeout=120)  # once as a real subprocess
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 2, proc.stderr
    assert "short: 2 eval point(s) to fit, need >= 4" in err[0]
    assert f"{missing}: no such run directory or eval.jsonl file" in err[1]
    assert "good: 7 points fitted" in proc.stdout and (tmp_path / "p.png").is_file()
    proc = scaling_inproc("fit", str(old), "--x", "flops", "--metric", "mean_at_k", "--out", str(tmp_path / "q.png"))
    assert proc.returncode == 2 and "no 'flops' field" in proc.stderr and "line 1" in proc.stderr
    proc = scaling_inproc("fit", str(good), "--metric", "accuracy", "--out", str(tmp_path / "q.png"))
    assert proc.returncode == 2 and "no metric 'accuracy'; available:" in proc.stderr
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "eval.jsonl").write_text('{"step": 0, "mean_at_k": 0.1}\n{oops\n')
    proc = scaling_inproc("fit", str(tmp_path / "bad"), "--out", str(tmp_path / "q.png"))
    assert proc.returncode == 2 and "eval.jsonl line 2: not JSON" in proc.stderr


def test_unidentified_fits_are_flagged_on_a_real_runs_curve():
    """Held-out mean@4 of a real 16-update SmolLM2 run (eval every 2 updates, 16 prompts): it jumped before the
    first post-baseline eval and then hovered, so no sigmoid is identified; the fit must say so."""
    steps = np.arange(2.0, 17.0, 2.0)
    values = np.array([0.59375, 0.5625, 0.546875, 0.53125, 0.5625, 0.578125, 0.59375, 0.703125])
    f = bootstrap_fit(steps, values, 0.296875, num_boot=200)
    assert f.warnings, (f.a, f.c_mid)
    assert any("not identified" in w or "before the fit window" in w for w in f.warnings)
    early = bootstrap_fit(steps[:5], values[:5], 0.296875, num_boot=200)
    assert any("before the fit window" in w for w in early.warnings), early.warnings
    # a well-sampled synthetic curve raises none
    c = np.geomspace(20, 5000, 16)
    assert bootstrap_fit(c, _noisy(c, 0), TRUE["r0"], num_boot=200).warnings == []
