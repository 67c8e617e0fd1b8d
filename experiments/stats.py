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


def _common_rows(per_seed: dict[int, list[dict]]) -> list[list[dict]]:
    """Per step that every seed reached (in order): each seed's eval record at that step."""
    by_step = [{r["step"]: r for r in recs} for recs in per_seed.values()]
    return [[d[s] for d in by_step] for s in sorted(set.intersection(*(set(d) for d in by_step)))]


def _per_prompt(rows: list[dict]) -> bool:
    """Whether the records carry per-prompt correctness over the same prompts (else: mean@k per seed)."""
    return all("correct" in r for r in rows) and len({len(r["correct"]) for r in rows}) == 1


def curve(
    per_seed: dict[int, list[dict]], x_key: str = "step", reps: int = 4000, seed: int = 0
) -> list[tuple[float, Interval]]:
    """One arm's accuracy curve with a band: `per_seed[seed]` is that run's eval records, each with `step` and
    `correct` (per-prompt fraction correct; absent: `mean_at_k`, seeds only). Points are the steps every seed
    reached; x is the mean of `x_key` over the seeds at that step (updates are equal, wall-clock is not)."""
    if not per_seed:
        return []
    out = []
    for rows in _common_rows(per_seed):
        if _per_prompt(rows):
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


@dataclass(frozen=True)
class Crossing:
    """A time (or a ratio of times) and its 95% percentile interval over bootstrap replicates."""

    time: float
    lo: float
    hi: float

    def cell(self, scale: float = 1.0, spec: str = ".1f") -> str:
        return f"{self.time * scale:{spec}} [{self.lo * scale:{spec}}, {self.hi * scale:{spec}}]"


def _curve_arrays(per_seed: dict[int, list[dict]], x_key: str) -> tuple[np.ndarray, np.ndarray]:
    """scores [steps, seeds, prompts] and x [steps, seeds] at the steps every seed reached (per-prompt fractions
    correct where every record has them, else each seed's mean@k as a single 'prompt')."""
    rows = _common_rows(per_seed)
    per_prompt = _per_prompt([r for row in rows for r in row])
    scores = np.array([[r["correct"] if per_prompt else [r["mean_at_k"]] for r in row] for row in rows], dtype=float)
    return scores, np.array([[r[x_key] for r in row] for row in rows], dtype=float)


def _first_crossing(means: np.ndarray, xs: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Per replicate (rows of means / xs, [reps, steps]; target [reps]): the x at which the piecewise-linear curve
    first reaches the target, interpolated between the eval points on either side; inf where it never does."""
    hit = means >= target[:, None] - 1e-12
    first = np.where(hit.any(axis=1), hit.argmax(axis=1), -1)
    out = np.full(means.shape[0], np.inf)
    for r, t in enumerate(first):
        if t == 0:
            out[r] = xs[r, 0]
        elif t > 0:
            m0, m1, x0, x1 = means[r, t - 1], means[r, t], xs[r, t - 1], xs[r, t]
            out[r] = x0 + (target[r] - m0) / (m1 - m0) * (x1 - x0)
    return out


@dataclass(frozen=True)
class TargetTimes:
    """When each arm's mean accuracy curve first reaches a common target (`time_to_target`)."""

    target: float  # from the plain means
    times: list[Crossing]  # per arm, in `x_key` units
    replicates: np.ndarray  # [reps, arms] times per bootstrap replicate (for ratios)
    point: np.ndarray  # [arms] times from the plain means
    level: float

    def ratio(self, a: int, b: int) -> Crossing:
        """Arm a's time over arm b's, with the interval from the same replicates (prompts drawn jointly). A
        replicate where both curves start at or above the target (0 / 0 at step 0 in FLOPs) has no ratio and is
        left out of the interval."""
        with np.errstate(divide="ignore", invalid="ignore"):
            point = self.point[a] / self.point[b]
            reps = self.replicates[:, a] / self.replicates[:, b]
        return _crossing(float(point), reps[~np.isnan(reps)], self.level)


def _crossing(point: float, reps: np.ndarray, level: float) -> Crossing:
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(reps, [alpha, 1.0 - alpha]) if reps.size else (np.nan, np.nan)
    return Crossing(float(point), float(lo), float(hi))


def _times(curves: list[tuple[np.ndarray, np.ndarray]], fraction: float, ws: list[np.ndarray], wp: np.ndarray):
    """Each arm's crossing time per replicate, and the replicate's target: base (mean over arms of the first eval)
    plus `fraction` of the smallest gain (the lowest final mean). The target is recomputed in every replicate, so
    a draw of easier or harder prompts moves the target with the curves instead of moving every crossing."""
    means, xs = [], []
    for (scores, x), w in zip(curves, ws):
        n_s, n_p = scores.shape[1], scores.shape[2]
        means.append(np.einsum("rs,tsp,rp->rt", w, scores, wp) / (n_s * n_p))
        xs.append(w @ x.T / n_s)
    base = np.mean([m[:, 0] for m in means], axis=0)
    target = base + fraction * (np.min([m[:, -1] for m in means], axis=0) - base)
    return np.stack([_first_crossing(m, x, target) for m, x in zip(means, xs)], axis=1), target


def time_to_target(
    per_arm: list[dict[int, list[dict]]], fraction: float, x_key: str = "wallclock_s", reps: int = 4000,
    level: float = 0.95, seed: int = 0,
) -> TargetTimes:
    """When each arm's mean curve (over seeds and held-out prompts) first reaches base + `fraction` x the smallest
    gain any of the arms made, in `x_key` units (`fraction` in (0, 1]: every arm's curve reaches the target within
    its run, by construction).

    Why the mean curve, interpolated, and not each seed's first eval point at or above a target: eval points come
    every few updates (a whole stage apart for Mu-GRPO), so 'first eval point' rounds every time up to the next
    point, more for arms with sparser evals, and a single seed's curve crosses a target by noise. The interval
    resamples each arm's seeds independently and the shared held-out prompts jointly (as `difference_interval`),
    and recomputes the target and the crossings per replicate. The arms must share base model and prompts."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction: expected 0 < fraction <= 1, got {fraction}")
    curves = [_curve_arrays(p, x_key) for p in per_arm]
    n_p = {c[0].shape[2] for c in curves}
    if len(n_p) != 1:
        raise ValueError(f"time_to_target: the arms were scored on different prompt counts {sorted(n_p)}")
    (n_p,) = n_p
    point, target = _times(curves, fraction, [np.ones((1, c[0].shape[1])) for c in curves], np.ones((1, n_p)))
    rng = np.random.default_rng(seed)
    ws = [_counts(rng, c[0].shape[1], reps) for c in curves]
    reps_t, _ = _times(curves, fraction, ws, _counts(rng, n_p, reps))
    times = [_crossing(point[0, i], reps_t[:, i], level) for i in range(len(curves))]
    return TargetTimes(float(target[0]), times, reps_t, point[0], level)
