"""Shared set-up of the policy tests: one fp32 Megatron policy on a single gloo rank, loaded from an HF folder."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def loaded_policy(model_dir: Path, token_budget: int):
    """A fp32 Policy with `model_dir`'s weights (each test module builds its own: the tests train it)."""
    from mcore_rl.distributed import init_distributed
    from mcore_rl.policy.policy import Policy, PolicyConfig

    init_distributed(1, 1)
    pol = Policy(model_dir, PolicyConfig(token_budget=token_budget))
    pol.load_hf(model_dir)
    return pol


@contextmanager
def restored(policy) -> Iterator[None]:
    """Weights and optimizer state back to what they were on entry: tests that take the same update twice from the
    same start, one way and another, compare the two."""
    start = copy.deepcopy(policy.model.state_dict()), copy.deepcopy(policy.optimizer.state_dict())
    try:
        yield
    finally:
        policy.model.load_state_dict(start[0])
        policy.optimizer.load_state_dict(start[1])
