"""One optimizer update straight on a Policy with a hand-written loss, for the tests that compare layouts,
precisions and weight syncs without an algorithm. The trainer's update (algorithm loss, exact aggregation, the
non-finite guard) is `mcore_rl.trainer.update.run_update`; both call the same Policy methods in the same order."""

from __future__ import annotations

from mcore_rl.policy.policy import LossFn, Policy
from mcore_rl.policy.step import PolicyBatch


def train_step(
    policy: Policy, batch: PolicyBatch, loss_fn: LossFn, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[list[dict], dict[str, float]]:
    """zero_grad -> forward_backward -> optimizer_step; returns (per-micro-batch loss outputs, step metrics)."""
    policy.zero_grad()
    outs = policy.forward_backward(batch, loss_fn, temperature, with_entropy)
    return outs, policy.optimizer_step()
