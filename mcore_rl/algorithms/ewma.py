"""Exponentially weighted moving average of the policy weights (the PPO-EWMA proximal policy).

Hilton et al.'s normalised EWMA: start with theta_bar = theta_0 and W = 1; after every optimizer step
    W' = beta * W + 1,   theta_bar <- (beta * W / W') * theta_bar + theta / W',   W <- W'
so theta_bar is the average of past iterates with weights beta^k, renormalised (no bias towards theta_0).
reset() is an update with beta = 0: theta_bar = theta, W = 1.
The same recurrence gives theta_bar's mean age in optimizer steps, a' = (beta * W / W') * (a + 1) (0 after
a reset, -> beta / (1 - beta) in steady state): how far the proximal policy lags the live weights, which
bounds the drift PPO-EWMA's train-infer gate must tolerate (ppo_ewma.py). `ewma_step` is that recurrence, shared with the
algorithm, which tracks the age without holding the weights.

The class keeps its own copy of whatever local tensors it is given (TP/PP shards included: each rank averages
its own shards, which is exact because the EWMA is element-wise). update(), reset() and swapped_in() must get
the same list, in the same order, every time. The copy is float32 by default so that averaging bf16 weights
does not accumulate rounding error.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from mcore_rl.utils import params_swapped


def ewma_step(weight: float, age: float, beta: float) -> tuple[float, float]:
    """(W, mean age in steps) after one optimizer step folded in with `beta` (beta = 0: a reset)."""
    new_weight = beta * weight + 1.0
    return new_weight, beta * weight / new_weight * (age + 1.0)


class EwmaWeights:
    def __init__(self, params: Sequence[Tensor], beta: float, dtype: torch.dtype | None = torch.float32) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"EWMA beta must be in [0, 1), got {beta}")
        self.beta = float(beta)
        self.weight = 1.0
        self.age = 0.0
        self.num_updates = 0
        self.num_resets = 0
        self.shadow = [p.detach().to(dtype or p.dtype, copy=True) for p in params]

    def _check(self, params: Sequence[Tensor]) -> None:
        if len(params) != len(self.shadow):
            raise ValueError(f"EwmaWeights holds {len(self.shadow)} tensors but got {len(params)}")
        for i, (s, p) in enumerate(zip(self.shadow, params)):
            if s.shape != p.shape:
                raise ValueError(f"EwmaWeights tensor {i}: shape {tuple(p.shape)} != stored {tuple(s.shape)}")

    @torch.no_grad()
    def update(self, params: Sequence[Tensor], beta: float | None = None) -> None:
        """Fold the current weights in; call after every optimizer step."""
        self._check(params)
        b = self.beta if beta is None else float(beta)
        new_weight, self.age = ewma_step(self.weight, self.age, b)
        decay = b * self.weight / new_weight
        for s, p in zip(self.shadow, params):
            if decay == 0.0:
                s.copy_(p.detach())
            else:
                s.mul_(decay).add_(p.detach().to(s.dtype), alpha=1.0 / new_weight)
        self.weight = new_weight
        self.num_updates += 1

    def reset(self, params: Sequence[Tensor]) -> None:
        """theta_bar = theta, W = 1 (the automatic-reset action)."""
        self.update(params, beta=0.0)
        self.num_resets += 1

    @contextmanager
    def swapped_in(self, params: Sequence[Tensor]) -> Iterator[None]:
        """Temporarily load the EWMA weights into the live params (for the proximal forward), then restore."""
        self._check(params)
        with params_swapped(params, self.shadow):
            yield

    def state_dict(self) -> dict[str, Any]:
        return {"beta": self.beta, "weight": self.weight, "age": self.age, "num_updates": self.num_updates,
                "num_resets": self.num_resets, "shadow": [s.clone() for s in self.shadow]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"beta", "weight", "shadow"} - set(state)
        if missing:
            raise ValueError(f"EwmaWeights state_dict lacks {sorted(missing)}")
        shadow = state["shadow"]
        self._check(shadow)
        with torch.no_grad():
            for s, v in zip(self.shadow, shadow):
                s.copy_(v)
        self.beta, self.weight = float(state["beta"]), float(state["weight"])
        self.age = float(state.get("age", 0.0))
        self.num_updates = int(state.get("num_updates", 0))
        self.num_resets = int(state.get("num_resets", 0))
