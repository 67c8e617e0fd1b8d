"""`mcore-rl-scaling fit RUN_DIR...`: fit ScaleRL's sigmoid to each run's held-out curve, print (A, B, C_mid) with
simultaneous bootstrap intervals, extrapolate, score held-out points, and draw one PNG of everything.

Exit codes: 0 every run fitted; 2 bad arguments or at least one run could not be fitted (one line per run on
stderr, the others are still fitted and drawn).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mcore_rl.evaluation.runs import X_AXES, Curve, RunError, load_curve
from mcore_rl.evaluation.scaling import CurveFit, FitError, bootstrap_fit


@dataclass
class RunFit:
    curve: Curve
    fit: CurveFit
    fit_mask: np.ndarray  # points used by the fit
    held_mask: np.ndarray  # points past --fit-until (prediction targets)


def select_points(curve: Curve, fit_from: float | None, fit_until: float | None) -> tuple[np.ndarray, np.ndarray]:
    """The first record is the baseline R0 (the trainer evaluates before the first update); the fit uses later
    points with x > 0 inside [fit_from, fit_until]; points past fit_until are held out."""
    x = curve.x
    later = np.arange(x.size) > 0
    fit = later & (x > 0)
    if fit_from is not None:
        fit &= x >= fit_from
    held = np.zeros_like(fit)
    if fit_until is not None:
        held = later & (x > fit_until)
        fit &= x <= fit_until
    return fit, held


def fit_run(curve: Curve, a: argparse.Namespace) -> RunFit:
    fit_mask, held_mask = select_points(curve, a.fit_from, a.fit_until)
    fit = bootstrap_fit(curve.x[fit_mask], curve.y[fit_mask], float(curve.y[0]), num_boot=a.bootstrap,
                        level=a.level, seed=a.seed, name=curve.name)
    return RunFit(curve, fit, fit_mask, held_mask)


def report(rf: RunFit, extrapolate: list[float]) -> dict:
    f, c = rf.fit, rf.curve
    print(f"{c.name}: {f.num_points} points fitted, R0={f.fit.r0:.4g}, rmse={f.fit.rmse:.3g} "
          f"({f.level:.0%} simultaneous intervals)")
    print(f"  A     = {f.a.text()}\n  B     = {f.b.text()}\n  C_mid = {f.c_mid.text()}")
    for w in f.warnings:
        print(f"  warning: {w}")
    out = {"run": c.name, "num_points": f.num_points, "r0": f.fit.r0, "rmse": f.fit.rmse, "level": f.level,
           **{k: {"value": iv.value, "lo": iv.lo, "hi": iv.hi} for k, iv in (("A", f.a), ("B", f.b),
                                                                             ("C_mid", f.c_mid))},
           "extrapolate": [], "held_out": [], "warnings": f.warnings}
    for cx in extrapolate:
        p = f.predict(cx)
        print(f"  R({cx:.4g}) = {p.text()}")
        out["extrapolate"].append({"x": cx, "value": p.value, "lo": p.lo, "hi": p.hi})
    if rf.held_mask.any():
        xs, ys = c.x[rf.held_mask], c.y[rf.held_mask]
        preds = f.fit.predict(xs)
        err = np.abs(preds - ys)
        print(f"  held-out: {xs.size} points past the fit window, mean |pred - actual| = {err.mean():.4g}; "
              f"at x={xs[-1]:.4g}: predicted {preds[-1]:.4g}, measured {ys[-1]:.4g}")
        out["held_out"] = [{"x": float(x), "measured": float(y), "predicted": float(p)}
                           for x, y, p in zip(xs, ys, preds)]
    return out


def plot(fits: list[RunFit], extrapolate: list[float], x_label: str, metric: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    shown: list[float] = []  # y values that set the axis range (not interval ends: a poorly fitted A can be wild)
    for i, rf in enumerate(fits):
        color = f"C{i}"
        c, f = rf.curve, rf.fit
        pos = c.x > 0
        unused = pos & ~rf.fit_mask & ~rf.held_mask
        ax.plot(c.x[rf.fit_mask], c.y[rf.fit_mask], "o", color=color, label=f"{c.name} (fitted points)")
        if unused.any():
            ax.plot(c.x[unused], c.y[unused], "o", mfc="none", color=color, alpha=0.6)
        if rf.held_mask.any():
            ax.plot(c.x[rf.held_mask], c.y[rf.held_mask], "X", color=color, ms=8, label=f"{c.name} (held out)")
        hi = max([c.x.max(), *extrapolate])
        grid = np.geomspace(c.x[pos].min(), hi, 200)
        shown += [*c.y.tolist(), *f.fit.predict(grid).tolist()]
        ax.plot(grid, f.fit.predict(grid), "-", color=color, alpha=0.8,
                label=f"fit A={f.a.value:.3g} B={f.b.value:.3g} C_mid={f.c_mid.value:.3g}")
        ax.axhline(f.a.value, color=color, ls=":", alpha=0.5)
        for cx in extrapolate:
            p = f.predict(cx)
            ax.errorbar([cx], [p.value], yerr=[[p.value - p.lo], [p.hi - p.value]], fmt="D", color=color, capsize=3)
    lo, hi = min(shown), max(shown)
    pad = 0.1 * max(hi - lo, 1e-3)
    ax.set_ylim(lo - pad, hi + pad)
    ax.set_xscale("log")
    ax.set_xlabel(x_label)
    ax.set_ylabel(metric)
    ax.set_title("R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _fit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", help="run directories (or their eval.jsonl files)")
    p.add_argument("--x", choices=sorted(X_AXES), default="updates", help="compute axis (default: updates)")
    p.add_argument("--metric", default="mean_at_k", help="eval.jsonl field to fit (default: mean_at_k)")
    p.add_argument("--fit-from", type=float, default=None,
                   help="ignore points with x below this (ScaleRL skips the early, noisy regime)")
    p.add_argument("--fit-until", type=float, default=None,
                   help="fit only points with x <= this; later points are held out and scored against the fit")
    p.add_argument("--extrapolate", type=float, action="append", default=[], metavar="C",
                   help="predict R at this x (repeatable)")
    p.add_argument("--bootstrap", type=int, default=400, help="bootstrap replicates (default: 400)")
    p.add_argument("--level", type=float, default=0.95, help="interval level (default: 0.95)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="scaling_fit.png", help="PNG to write (default: scaling_fit.png)")
    p.add_argument("--json", default=None, help="also write the fits as JSON here")


def run_fit(a: argparse.Namespace) -> int:
    if a.bootstrap < 20:
        raise SystemExit("mcore-rl-scaling: error: --bootstrap must be >= 20")
    if a.fit_from is not None and a.fit_until is not None and a.fit_from >= a.fit_until:
        raise SystemExit("mcore-rl-scaling: error: --fit-from must be below --fit-until")
    fits, rows, failed = [], [], 0
    for run in a.runs:
        try:
            rf = fit_run(load_curve(run, a.x, a.metric), a)
        except (RunError, FitError) as e:
            print(f"mcore-rl-scaling: error: {e}", file=sys.stderr)
            failed += 1
            continue
        fits.append(rf)
        rows.append(report(rf, a.extrapolate))
    if fits:
        path = plot(fits, a.extrapolate, fits[0].curve.x_label, a.metric, Path(a.out))
        print(f"wrote {path}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2) + "\n")
        print(f"wrote {a.json}")
    return 2 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mcore-rl-scaling", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    fit = sub.add_parser("fit", help="fit the ScaleRL sigmoid to runs' held-out curves")
    _fit_args(fit)
    fit.set_defaults(func=run_fit)
    a = parser.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
