"""One SFT optimizer step and the held-out loss, through the policy's own forward/backward.

The loss is the token mean of -log p over the assistant tokens of the whole global batch: each scored token's
weight is 1 / (scored tokens summed over every data-parallel rank), so the summed micro-batch losses are the
batch loss whatever the micro-batch, TP, PP or DP split (as RL's aggregation weights, trainer/update.py). The log
probabilities come from the policy's scored-token head (policy/step.py): the LM head runs only where a scored
token is predicted, in chunks, so no [tokens, vocabulary] tensor is ever held.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mcore_rl.distributed import all_reduce, broadcast_floats
from mcore_rl.policy.step import PolicyBatch
from mcore_rl.sft.template import Example
from mcore_rl.trainer.update import NonFiniteGuard, dp_reducer


def policy_batch(examples: Sequence[Example]) -> PolicyBatch:
    """Right-padded rows; loss_mask[t] = 1 where token t is an assistant token (predicted from the ones before).
    No rows (a data-parallel rank whose share of a small batch is empty): one unscored row, so that the rank still
    joins every collective of the step."""
    if not examples:
        return PolicyBatch(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8))
    n, length = len(examples), max((len(e.ids) for e in examples), default=1)
    tokens = torch.zeros(n, length, dtype=torch.long)
    mask = torch.zeros(n, length)
    for i, e in enumerate(examples):
        tokens[i, : len(e.ids)] = torch.tensor(e.ids)
        mask[i, : len(e.mask)] = torch.tensor(e.mask, dtype=torch.float32)
    mask[:, 0] = 0.0  # nothing predicts the first token
    return PolicyBatch(tokens, mask)


def _global_count(mask: torch.Tensor) -> float:
    reduce = dp_reducer()
    return float(reduce(mask.sum().double().reshape(1)).item())


def _sft_loss(mb: PolicyBatch, logp: torch.Tensor, entropy: torch.Tensor | None):
    w = mb.extras["w"]
    loss = -(logp.float() * w).sum()
    return loss, {"loss": float(loss.detach()), "tokens": float(mb.loss_mask.sum())}


def train_step(policy, examples: Sequence[Example], guard: NonFiniteGuard, step: int) -> dict[str, float]:
    """Collective. This DP rank's share `examples` of one global batch: forward/backward, optimizer step."""
    batch = policy_batch(examples)
    count = _global_count(batch.loss_mask)
    batch.extras["w"] = batch.loss_mask / max(count, 1.0)
    policy.zero_grad()
    outs = policy.forward_backward(batch, _sft_loss)
    local = sum(o["loss"] for o in outs) if outs else 0.0
    # the batch loss: this rank's share summed over DP (on the last PP stage), then sent to every stage
    loss = float(all_reduce(torch.tensor([local], dtype=torch.float64), "sum", _dp_group()).item())
    loss = _from_last_stage([loss])[0]
    metrics = {"loss": loss, "train_tokens": count}
    if guard.should_skip(policy.model, metrics, step):
        metrics.update({"grad_norm": float("nan"), "update_ok": 0.0})
        return metrics
    metrics.update(policy.optimizer_step())
    return metrics


def _from_last_stage(values: list[float]) -> list[float]:
    """Only the last pipeline stage computes the loss; every stage logs and decides on the same numbers."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return values
    group = ps.get_pipeline_model_parallel_group()
    return broadcast_floats(values, src=dist.get_global_rank(group, group.size() - 1), group=group)


def _dp_group():
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group()


def heldout_loss(policy, examples: Sequence[Example], rows_per_pass: int = 64) -> float:
    """Collective. Token-mean NLL of the assistant tokens of this DP rank's held-out share, over every rank."""
    total = torch.zeros(2, dtype=torch.float64)  # (sum of -log p, scored tokens)
    # every DP rank runs as many passes (each pass has collectives); a rank with fewer rows runs empty ones
    passes = int(all_reduce(torch.tensor([-(-len(examples) // rows_per_pass)]), "max", _dp_group()).item())
    for p in range(passes):
        part = list(examples[p * rows_per_pass : (p + 1) * rows_per_pass])
        batch = policy_batch(part)
        logp = policy.logprobs(batch)  # None off the last PP stage
        if logp is not None and part:
            total += torch.tensor(
                [float(-(logp * batch.loss_mask).sum()), float(batch.loss_mask.sum())], dtype=torch.float64
            )
    total = all_reduce(total, "sum", _dp_group())
    nll, count = _from_last_stage([float(total[0]), float(total[1])])
    return nll / count if count > 0 else math.nan
