"""Error bars for the experiments: a bootstrap over training seeds and held-out prompts.

Why both: an arm's held-out accuracy varies with the training seed (what the claim is about) and with which prompts
happen to be in the held-out set (32-64 prompts: one prompt is 2-3 points of accuracy). The seeds and the prompts
are crossed (every seed is evaluated on the same fixed prompts), so one replicate draws seeds with replacement AND
prompts with replacement, independently, and takes the mean over the drawn block (the "two-way" or "crossed" bootstrap
of Owen 2007, which is slightly conservative: it counts the seed x prompt noise twice). The percentile interval
of the replicates is the reported 95% interval.

What it cannot do: with 3 seeds there are only 10 distinct seed resamples, so the seed part of the spread is
under-estimated (a percentile bootstrap over n items covers at about the rate of a z-interval with n in the
denominator instead of n - 1). `tests/evaluation/test_exp_stats.py` measures the coverage; the numbers are in
experiments/README.md. Read an interval from 3 seeds as "at least this uncertain".

Input: `scores[s, p]` = the fraction of the k samples of held-out prompt p that were correct, for training seed s,
at one eval point of one arm. A 1-D array (per-seed means only, no per-prompt data) falls back to seeds only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Interval:
    mean: float  # the plain mean over seeds and prompts (not the bootstrap mean)
    lo: float
    hi: float
    n_seeds: int
    n_prompts: int  # 0: seeds only (no per-prompt data)

    def cell(self, spec: str = ".3f") -> str:
        """A table cell: `0.412 [0.380, 0.445]` (a single seed and no prompts: the mean alone)."""
        if self.n_seeds <= 1 and self.n_prompts == 0:
            return format(self.mean, spec)
        return f"{self.mean:{spec}} [{self.lo:{spec}}, {self.hi:{spec}}]"


def _counts(rng: np.random.Generator, n: int, reps: int) -> np.ndarray:
    """Multinomial resampling weights: row r says how often each of the n items was drawn in replicate r."""
    idx = rng.integers(0, n, size=(reps, n))
    out = np.zeros((reps, n))
    np.add.at(out, (np.arange(reps)[:, None], idx), 1.0)
    return out


def bootstrap_interval(
    scores: Sequence | np.ndarray, reps: int = 4000, level: float = 0.95, seed: int = 0
) -> Interval:
    """Mean and percentile interval of `scores` ([seeds, prompts], or [seeds]) under the crossed bootstrap.

    Deterministic given `seed`. Vectorised: replicate r's statistic is w_s[r] @ S @ w_p[r] / (n_s n_p) with
    multinomial weights, so 4000 replicates of a 5 x 64 block take milliseconds."""
    s = np.asarray(scores, dtype=float)
    if s.ndim == 1:
        s = s[:, None]
        n_prompts = 0
    elif s.ndim == 2:
        n_prompts = s.shape[1]
    else:
        raise ValueError(f"scores: expected [seeds] or [seeds, prompts], got shape {s.shape}")
    if s.size == 0 or not np.isfinite(s).all():
        raise ValueError(f"scores: need a non-empty, finite array, got shape {s.shape}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level: expected 0 < level < 1, got {level}")
    n_s, n_p = s.shape
    rng = np.random.default_rng(seed)
    ws = _counts(rng, n_s, reps)
    wp = _counts(rng, n_p, reps) if n_prompts else np.ones((reps, 1))
    stats = np.einsum("rs,sp,rp->r", ws, s, wp) / (n_s * n_p)
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(stats, [alpha, 1.0 - alpha])
    return Interval(float(s.mean()), float(lo), float(hi), n_s, n_prompts)


def difference_interval(
    a: Sequence | np.ndarray, b: Sequence | np.ndarray, reps: int = 4000, level: float = 0.95, seed: int = 0
) -> Interval:
    """Interval of mean(a) - mean(b) for two arms evaluated on the same prompts ([seeds_a, P], [seeds_b, P]): the
    prompts are resampled jointly (the same draw for both arms, since the prompts are shared), the seeds of each arm
    independently (the arms' seeds are separate runs)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(
            f"difference_interval: need [seeds, prompts] arrays on the same prompts, got {a.shape} "
            f"and {b.shape}"
        )
    rng = np.random.default_rng(seed)
    wa, wb, wp = (
        _counts(rng, a.shape[0], reps),
        _counts(rng, b.shape[0], reps),
        _counts(rng, a.shape[1], reps),
    )
    n_p = a.shape[1]
    stats = np.einsum("rs,sp,rp->r", wa, a, wp) / (a.shape[0] * n_p) - np.einsum("rs,sp,rp->r", wb, b, wp) / (
        b.shape[0] * n_p
    )
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(stats, [alpha, 1.0 - alpha])
    return Interval(float(a.mean() - b.mean()), float(lo), float(hi), min(a.shape[0], b.shape[0]), n_p)


def curve(
    per_seed: dict[int, list[dict]], x_key: str = "step", reps: int = 4000, seed: int = 0
) -> list[tuple[float, Interval]]:
    """One arm's accuracy curve with a band: `per_seed[seed]` is that run's eval records, each with `step` and
    `correct` (per-prompt fraction correct; absent: `mean_at_k`, seeds only). Points are the steps every seed
    reached; x is the mean of `x_key` over the seeds at that step (updates are equal, wall-clock is not)."""
    if not per_seed:
        return []
    by_step = [{r["step"]: r for r in recs} for recs in per_seed.values()]
    common = sorted(set.intersection(*(set(d) for d in by_step)))
    out = []
    for step in common:
        rows = [d[step] for d in by_step]
        if all("correct" in r for r in rows) and len({len(r["correct"]) for r in rows}) == 1:
            scores = np.array([r["correct"] for r in rows], dtype=float)
        else:
            scores = np.array([r["mean_at_k"] for r in rows], dtype=float)
        x = float(np.mean([r[x_key] for r in rows]))
        out.append((x, bootstrap_interval(scores, reps=reps, seed=seed)))
    return out


def plot_bands(ax, points: list[tuple[float, Interval]], label: str, x_scale: float = 1.0, **line_kw) -> None:
    """The mean as a line with markers and the interval as a shaded band of the same colour."""
    if not points:
        return
    xs = [x * x_scale for x, _ in points]
    (line,) = ax.plot(xs, [iv.mean for _, iv in points], marker="o", ms=3, label=label, **line_kw)
    ax.fill_between(
        xs, [iv.lo for _, iv in points], [iv.hi for _, iv in points], color=line.get_color(), alpha=0.2, lw=0
    )
