"""Small helpers shared across rooms."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch


def config_from_dict(cls: type, options: Mapping[str, Any], where: str) -> Any:
    """Build a config dataclass, naming the offending key and the valid ones on a typo."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"{where}: unknown option(s) {unknown}; known: {sorted(known)}")
    return cls(**options)


@contextmanager
def params_restored(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Whatever the block writes into `params` in place, their values at entry come back when it ends (also on an
    exception): a trial update or a weight swap that must not leak into the live model."""
    with torch.no_grad():
        backup = [p.detach().clone() for p in params]
    try:
        yield
    finally:
        with torch.no_grad():
            for p, b in zip(params, backup):
                p.copy_(b)


@contextmanager
def params_swapped(params: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> Iterator[None]:
    """Load `values` into the live `params` for the duration of the block, then restore the originals: one
    forward under other weights (EWMA proximal policy, an older snapshot) without a second model in memory."""
    with params_restored(params):
        with torch.no_grad():
            for p, v in zip(params, values):
                p.copy_(v.to(p.device))
        yield
