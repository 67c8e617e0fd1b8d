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
    """Batched: p [S, 3] = (A, log B, log C_mid) per problem, r [S, m] -> residuals [S, m], Jacobian [S, m, 3]."""
    a, b, log_cm = p[:, :1], np.exp(p[:, 1:2]), p[:, 2:3]
    u = np.exp(np.clip(b * (log_cm - logc[None, :]), -700, 700))
    pred = r0 + (a - r0) / (1 + u)
    du = -(a - r0) / (1 + u) ** 2
    jac = np.stack([1 / (1 + u), du * u * (log_cm - logc[None, :]) * b, du * u * b], axis=2)
    return pred - r, jac


def _lm(p: np.ndarray, logc: np.ndarray, r: np.ndarray, r0: float, iters: int) -> tuple[np.ndarray, np.ndarray]:
    """Levenberg-Marquardt on S independent problems at once (one damping factor each), so a bootstrap of
    hundreds of refits costs about as much as one fit. Returns (params [S, 3], costs [S])."""
    p = p.copy()
    lam = np.full(p.shape[0], 1e-3)
    res, jac = _residual_jacobian(p, logc, r, r0)
    cost = np.einsum("sm,sm->s", res, res)
    active = np.ones(p.shape[0], dtype=bool)
    eye = np.eye(3)
    with np.errstate(over="ignore", invalid="ignore"):
        for _ in range(iters):
            if not active.any():
                break
            jtj = np.einsum("smi,smj->sij", jac, jac)
            g = np.einsum("smi,sm->si", jac, res)
            damp = lam[:, None, None] * (np.einsum("sii->si", jtj)[:, :, None] * eye + 1e-12 * eye)
            try:
                step = np.linalg.solve(jtj + damp, -g[:, :, None])[:, :, 0]
            except np.linalg.LinAlgError:
                step = np.stack([np.linalg.lstsq(m, -v, rcond=None)[0] for m, v in zip(jtj + damp, g)])
            cand = np.where(active[:, None], p + step, p)
            res_c, jac_c = _residual_jacobian(cand, logc, r, r0)
            cost_c = np.einsum("sm,sm->s", res_c, res_c)
            better = active & np.isfinite(cost_c) & (cost_c < cost)
            converged = better & (cost - cost_c < 1e-30)
            p[better], res[better], jac[better] = cand[better], res_c[better], jac_c[better]
            cost = np.where(better, cost_c, cost)
            lam = np.where(better, np.maximum(lam / 3, 1e-12), np.where(active, lam * 4, lam))
            active &= ~converged & (lam <= 1e12)
    return p, cost


def _check(c: np.ndarray, r: np.ndarray) -> None:
    if c.ndim != 1 or r.shape[-1] != c.size or c.size < 3:
        raise ValueError(f"fit_sigmoid needs >= 3 matching (compute, reward) points, got {c.shape} and {r.shape}")
    if np.any(c <= 0):
        raise ValueError("fit_sigmoid: compute values must be > 0")


def fit_sigmoid(compute: np.ndarray, reward: np.ndarray, r0: float, iters: int = 500) -> SigmoidFit:
    """Least-squares fit of (A, B, C_mid) with R0 fixed; several starts, best kept."""
    c = np.asarray(compute, dtype=np.float64)
    r = np.asarray(reward, dtype=np.float64)
    if c.shape != r.shape:
        raise ValueError(f"fit_sigmoid needs >= 3 matching (compute, reward) points, got {c.shape} and {r.shape}")
    _check(c, r)
    logc = np.log(c)
    a0 = r.max() + 0.1 * abs(r.max() - r0) + 1e-3
    half = r0 + 0.5 * (r.max() - r0)
    cm0 = float(np.log(c[np.argmin(np.abs(r - half))]))
    starts = np.array([[a0, np.log(b0), cm0] for b0 in (0.5, 1.0, 2.0, 4.0)])
    params, costs = _lm(starts, logc, np.broadcast_to(r, (len(starts), r.size)), r0, iters)
    best = int(np.nanargmin(np.where(np.isfinite(costs), costs, np.inf)))
    p, cost = params[best], float(costs[best])
    return SigmoidFit(float(p[0]), float(np.exp(p[1])), float(np.exp(p[2])), float(r0), float(np.sqrt(cost / c.size)))


def refit_sigmoid(compute: np.ndarray, rewards: np.ndarray, start: SigmoidFit, iters: int = 200) -> np.ndarray:
    """Refit many reward vectors `rewards` [S, m] (bootstrap replicates) from one start, in one batched solve.
    Returns [S, 3] rows of (A, B, C_mid); rows that did not reach a finite cost are NaN."""
    c = np.asarray(compute, dtype=np.float64)
    r = np.atleast_2d(np.asarray(rewards, dtype=np.float64))
    _check(c, r)
    p0 = np.tile([start.a, np.log(start.b), np.log(start.c_mid)], (r.shape[0], 1))
    p, cost = _lm(p0, np.log(c), r, start.r0, iters)
    with np.errstate(over="ignore"):
        out = np.stack([p[:, 0], np.exp(p[:, 1]), np.exp(p[:, 2])], axis=1)
    out[~np.isfinite(cost)] = np.nan
    return out
