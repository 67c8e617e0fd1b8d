"""Small tensor helpers shared by the losses: safe log-ratios, the k3 KL estimator, masked statistics."""

from __future__ import annotations

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0   # exp(+-20): safety bound on log-ratios (verl)
KL_CLAMP = 10.0          # k3's exponent is clamped to +-10 (FeynRL)


def log_ratio(num: Tensor, den: Tensor, mask: Tensor, clamp: float = LOG_RATIO_CLAMP) -> Tensor:
    """num - den, clamped, and zero on padding *before* any exp so padded garbage can never overflow."""
    lr = (num - den).clamp(-clamp, clamp)
    return torch.where(mask > 0, lr, torch.zeros_like(lr))


def k3(logp: Tensor, logq: Tensor, mask: Tensor, clamp: float = KL_CLAMP) -> Tensor:
    """k3 estimator of KL(p || q) on samples of p: exp(x) - x - 1 with x = logq - logp (>= 0, low variance)."""
    x = log_ratio(logq, logp, mask, clamp)
    return torch.exp(x) - x - 1.0


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    m = mask > 0
    return torch.where(m, x, torch.zeros_like(x)).sum() / m.sum().clamp(min=1).to(x.dtype)


def masked_max(x: Tensor, mask: Tensor) -> Tensor:
    sel = x[mask > 0]
    return sel.max() if sel.numel() else x.new_zeros(())


def masked_min(x: Tensor, mask: Tensor) -> Tensor:
    sel = x[mask > 0]
    return sel.min() if sel.numel() else x.new_zeros(())


def to_floats(metrics: dict[str, Tensor | float]) -> dict[str, float]:
    """Detach metric tensors into Python floats with a single device->host copy."""
    keys = [k for k, v in metrics.items() if isinstance(v, Tensor)]
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, Tensor)}
    if keys:
        vals = torch.stack([metrics[k].detach().reshape(()).to(torch.float64) for k in keys]).cpu().tolist()
        out.update(zip(keys, vals))
    return out
