"""ScaleRL's compute-performance curve and a dependency-free least-squares fit.

    R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)
R = mean validation pass rate at compute C; A = asymptote; B > 0 = efficiency exponent; C_mid = compute at half
of the total gain; R0 = initial reward. We fix R0 (measured at step 0) and fit (A, log B, log C_mid) by
Levenberg-Marquardt from several starting exponents, so B and C_mid stay positive without bounds handling.
Drop the early noisy regime (ScaleRL skips ~the first 1.5k GPU-hours) before fitting.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def sigmoid_curve(compute: np.ndarray | float, a: float, b: float, c_mid: float, r0: float) -> np.ndarray:
    c = np.asarray(compute, dtype=np.float64)
    return r0 + (a - r0) / (1.0 + (c_mid / c) ** b)


@dataclass
class SigmoidFit:
    a: float
    b: float
    c_mid: float
    r0: float
    rmse: float

    def predict(self, compute: np.ndarray | float) -> np.ndarray:
        return sigmoid_curve(compute, self.a, self.b, self.c_mid, self.r0)


def _residual_jacobian(p: np.ndarray, logc: np.ndarray, r: np.ndarray, r0: float) -> tuple[np.ndarray, np.ndarray]:
    a, b, log_cm = p[0], np.exp(p[1]), p[2]
    u = np.exp(np.clip(b * (log_cm - logc), -700, 700))
    pred = r0 + (a - r0) / (1 + u)
    du = -(a - r0) / (1 + u) ** 2
    jac = np.stack([1 / (1 + u), du * u * (log_cm - logc) * b, du * u * b], axis=1)
    return pred - r, jac


def _lm(p: np.ndarray, logc: np.ndarray, r: np.ndarray, r0: float, iters: int) -> tuple[np.ndarray, float]:
    lam = 1e-3
    res, jac = _residual_jacobian(p, logc, r, r0)
    cost = float(res @ res)
    for _ in range(iters):
        jtj, g = jac.T @ jac, jac.T @ res
        step = np.linalg.solve(jtj + lam * np.diag(np.diag(jtj) + 1e-12), -g)
        cand = p + step
        res_c, jac_c = _residual_jacobian(cand, logc, r, r0)
        cost_c = float(res_c @ res_c)
        if np.isfinite(cost_c) and cost_c < cost:
            p, res, jac, lam = cand, res_c, jac_c, max(lam / 3, 1e-12)
            if cost - cost_c < 1e-30:
                cost = cost_c
                break
            cost = cost_c
        else:
            lam *= 4
            if lam > 1e12:
                break
    return p, cost


def fit_sigmoid(compute: np.ndarray, reward: np.ndarray, r0: float, iters: int = 500) -> SigmoidFit:
    """Least-squares fit of (A, B, C_mid) with R0 fixed; several starts, best kept."""
    c = np.asarray(compute, dtype=np.float64)
    r = np.asarray(reward, dtype=np.float64)
    if c.shape != r.shape or c.ndim != 1 or c.size < 3:
        raise ValueError(f"fit_sigmoid needs >= 3 matching (compute, reward) points, got {c.shape} and {r.shape}")
    if np.any(c <= 0):
        raise ValueError("fit_sigmoid: compute values must be > 0")
    logc = np.log(c)
    a0 = r.max() + 0.1 * abs(r.max() - r0) + 1e-3
    half = r0 + 0.5 * (r.max() - r0)
    cm0 = float(np.log(c[np.argmin(np.abs(r - half))]))
    best_p, best_cost = None, np.inf
    for b0 in (0.5, 1.0, 2.0, 4.0):
        p, cost = _lm(np.array([a0, np.log(b0), cm0]), logc, r, r0, iters)
        if cost < best_cost:
            best_p, best_cost = p, cost
    return SigmoidFit(float(best_p[0]), float(np.exp(best_p[1])), float(np.exp(best_p[2])), float(r0),
                      float(np.sqrt(best_cost / c.size)))
