"""ScaleRL sigmoid fits of a run's held-out curve, with bootstrap intervals and extrapolation.

The curve and the least-squares fit live in mcore_rl/algorithms/scaling_curve.py; this module adds what a user
needs to trust a fit: which points were used, residual-bootstrap intervals for (A, B, C_mid) and for predictions,
and the error on held-out points past the fitting window (did the extrapolation hold?).

Why a residual bootstrap (not resampling points): a run has ~5-30 eval points spread over compute; resampling the
points drops whole regions of the curve and makes B and C_mid unidentifiable, while resampling residuals keeps
the design fixed, as in nonlinear-regression practice. Residuals are inflated by sqrt(m / (m - 3)) because three
parameters were fitted to m points.

Why studentized, simultaneous intervals: plain percentile intervals of the replicates covered each true parameter
only ~87-91% of the time at a nominal 95% on 10-16 point curves (measured), and all three together ~75-80%.
We bootstrap the t-statistics of (A, log B, log C_mid) (standard errors from each refit's Jacobian) and take the
quantile of their maximum over the three parameters (a sup-t band), so the three intervals hold *together* at the
stated level: measured 90-97% joint coverage for 10-24 points, 87% at 8 points (tests/evaluation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mcore_rl.algorithms.scaling_curve import SigmoidFit, fit_sigmoid, refit_sigmoid, sigmoid_curve
from mcore_rl.algorithms.scaling_curve import _residual_jacobian as residual_jacobian

MIN_FIT_POINTS = 4  # 3 parameters: with 3 points the fit interpolates and the bootstrap has no residuals


class FitError(ValueError):
    """A run cannot be fitted (too few points, no variation); the message is one line and names the run."""


@dataclass
class Interval:
    value: float
    lo: float
    hi: float

    def contains(self, x: float) -> bool:
        return self.lo <= x <= self.hi

    def text(self, fmt: str = ".4g") -> str:
        return f"{self.value:{fmt}} [{self.lo:{fmt}}, {self.hi:{fmt}}]"


@dataclass
class CurveFit:
    """A fit with its intervals. `replicates` [B, 3] holds the bootstrap (A, B, C_mid) rows that converged."""

    fit: SigmoidFit
    a: Interval
    b: Interval
    c_mid: Interval
    level: float
    num_points: int
    replicates: np.ndarray = field(repr=False)
    warnings: list[str] = field(default_factory=list)

    def predict(self, compute: float) -> Interval:
        """Point prediction and the bootstrap interval of the predicted R at `compute`."""
        reps = self.replicates
        draws = sigmoid_curve(compute, reps[:, 0], reps[:, 1], reps[:, 2], self.fit.r0)
        lo, hi = _quantiles(draws, self.level)
        return Interval(float(self.fit.predict(compute)), lo, hi)


def _quantiles(x: np.ndarray, level: float) -> tuple[float, float]:
    tail = (1.0 - level) / 2.0
    return float(np.quantile(x, tail)), float(np.quantile(x, 1.0 - tail))


def _log_params(rows: np.ndarray) -> np.ndarray:
    """(A, B, C_mid) -> (A, log B, log C_mid): the space the fit works in and where errors are ~symmetric."""
    return np.stack([rows[:, 0], np.log(rows[:, 1]), np.log(rows[:, 2])], axis=1)


def standard_errors(theta: np.ndarray, compute: np.ndarray, rewards: np.ndarray, r0: float) -> np.ndarray:
    """Asymptotic standard errors of (A, log B, log C_mid), batched: theta [S, 3], rewards [S, m] -> [S, 3]."""
    res, jac = residual_jacobian(theta, np.log(compute), rewards, r0)
    s2 = np.einsum("sm,sm->s", res, res) / (compute.size - 3)
    cov = np.linalg.pinv(np.einsum("smi,smj->sij", jac, jac)) * s2[:, None, None]
    return np.sqrt(np.maximum(np.einsum("sii->si", cov), 1e-300))


def bootstrap_fit(compute: np.ndarray, reward: np.ndarray, r0: float, num_boot: int = 200, level: float = 0.95,
                  seed: int = 0, name: str = "curve") -> CurveFit:
    """Fit R(C) with R0 fixed, then refit `num_boot` residual-bootstrap replicates in one batched solve."""
    c = np.asarray(compute, dtype=np.float64)
    r = np.asarray(reward, dtype=np.float64)
    m = c.size
    if m < MIN_FIT_POINTS:
        raise FitError(f"{name}: {m} eval point(s) to fit, need >= {MIN_FIT_POINTS} (evaluate more often: "
                       "eval.every, or widen --fit-from/--fit-until)")
    if np.ptp(r) == 0 and r[0] == r0:
        raise FitError(f"{name}: the metric never moves from R0={r0:g}; a sigmoid has nothing to fit")
    if not 0.5 <= level < 1.0:
        raise ValueError(f"interval level must be in [0.5, 1); got {level}")
    fit = fit_sigmoid(c, r, r0)
    fitted = fit.predict(c)
    resid = (r - fitted) * np.sqrt(m / (m - 3))
    resid -= resid.mean()
    rng = np.random.default_rng(seed)
    boot_r = fitted[None, :] + rng.choice(resid, size=(num_boot, m), replace=True)
    reps = refit_sigmoid(c, boot_r, fit)
    ok = np.all(np.isfinite(reps), axis=1)
    reps, boot_r = reps[ok], boot_r[ok]
    if len(reps) < max(10, num_boot // 2):
        raise FitError(f"{name}: only {len(reps)}/{num_boot} bootstrap refits converged; the curve is too flat "
                       "or too noisy to fit")
    est = np.array([fit.a, fit.b, fit.c_mid])
    theta = _log_params(est[None, :])
    se0 = standard_errors(theta, c, r[None, :], r0)[0]
    theta_b = _log_params(reps)
    t_star = np.abs(theta_b - theta) / standard_errors(theta_b, c, boot_r, r0)
    q = float(np.quantile(t_star.max(axis=1), level))
    lo, hi = theta[0] - q * se0, theta[0] + q * se0
    with np.errstate(over="ignore"):
        lo[1:], hi[1:] = np.exp(lo[1:]), np.exp(hi[1:])
    ivs = [Interval(float(v), float(a), float(b)) for v, a, b in zip(est, lo, hi)]
    return CurveFit(fit, *ivs, level=level, num_points=m, replicates=reps, warnings=identification_warnings(fit, c))


def identification_warnings(fit: SigmoidFit, compute: np.ndarray) -> list[str]:
    """A least-squares fit always returns numbers; these say when the data cannot pin them down, so nobody
    quotes an asymptote from a curve that never bent (measured on a real 16-update SmolLM2 run that jumped
    0.30 -> 0.59 before its first post-baseline eval and then hovered: A=173, C_mid=1e26)."""
    out = []
    lo, hi = float(compute.min()), float(compute.max())
    if fit.c_mid > 10 * hi:
        out.append(f"C_mid={fit.c_mid:.3g} is >10x beyond the last fitted point ({hi:.3g}): the curve has not bent "
                   "toward an asymptote in the data, so A and C_mid are not identified")
    if fit.c_mid < lo / 10:
        out.append(f"C_mid={fit.c_mid:.3g} is <1/10 of the first fitted point ({lo:.3g}): the rise happened before "
                   "the fit window (evaluate earlier/more often, or lower --fit-from)")
    if not 0.0 <= fit.a <= 1.0:
        out.append(f"A={fit.a:.3g} lies outside [0, 1]: not a possible pass rate")
    return out
