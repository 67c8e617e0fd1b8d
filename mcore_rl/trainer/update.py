"""One optimizer update: algorithm loss over micro-batches, exact global aggregation, optimizer step.

The algorithm's `token_weights` carry every global denominator (all-reduced over the data-parallel group), so the
summed micro-batch losses are the batch loss whatever the micro-batch or DP split. Only the last pipeline stage
sees the loss: step-level decisions (the deferred renormalisation scale, PPO-EWMA resets) are broadcast from it.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from mcore_rl.algorithms import Algorithm, TokenBatch
from mcore_rl.distributed import broadcast_floats, sum_reducer
from mcore_rl.trainer.rollout_batch import RolloutBatch


def dp_reducer():
    from megatron.core import parallel_state as ps

    return sum_reducer(ps.get_data_parallel_group())


def _broadcast_from_last_stage(values: list[float]) -> list[float]:
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return values
    group = ps.get_pipeline_model_parallel_group()
    return broadcast_floats(values, src=dist.get_global_rank(group, group.size() - 1), group=group)


ADDITIVE = ("loss", "pg_loss")  # micro-batch losses are pre-normalised terms of one sum


def mean_metrics(dicts: list[dict]) -> dict[str, float]:
    """Combine per-micro-batch metrics: sums for loss terms, max/min for *_max/*_min, means otherwise."""
    acc: dict[str, list[float]] = defaultdict(list)
    for d in dicts:
        for k, v in d.items():
            if isinstance(v, (int, float)):
                acc[k].append(float(v))
    out = {}
    for k, v in acc.items():
        if k in ADDITIVE:
            out[k] = sum(v)
        elif k.endswith("_max"):
            out[k] = max(v)
        elif k.endswith("_min"):
            out[k] = min(v)
        else:
            out[k] = sum(v) / len(v)
    return out


def run_update(policy, alg: Algorithm, rb: RolloutBatch, advantages: torch.Tensor, keep: torch.Tensor,
               anchors: dict[str, torch.Tensor], temperature: float, ewma=None) -> dict[str, float]:
    """Train on this DP rank's rows `rb` of one mini-batch. `anchors`: old_logp / prox_logp / ref_logp [N, L]."""
    reduce = dp_reducer()
    weights = alg.token_weights(rb.loss_mask, rb.group_ids, reduce, keep)
    adv_tok = advantages[:, None].float() * rb.loss_mask
    extras = {"adv": adv_tok, "rollout_logp": rb.rollout_logp, "w": weights.float(), **anchors}
    batch = rb.policy_batch(**extras)

    def loss_fn(mb, logp, entropy):
        tb = TokenBatch(
            logp=logp, mask=mb.loss_mask, advantages=mb.extras["adv"], rollout_logp=mb.extras["rollout_logp"],
            token_weight=mb.extras["w"], old_logp=mb.extras.get("old_logp"), prox_logp=mb.extras.get("prox_logp"),
            ref_logp=mb.extras.get("ref_logp"), entropy=entropy if alg.needs_entropy else None,
        )
        loss, metrics = alg.loss(tb, reduce)
        if entropy is not None and "entropy" not in metrics:
            m = mb.loss_mask
            metrics["entropy"] = float((entropy.detach() * m).sum() / m.sum().clamp(min=1))
        return loss, metrics

    policy.zero_grad()
    outs = policy.forward_backward(batch, loss_fn, temperature, with_entropy=True)
    metrics = mean_metrics(outs) if outs else {}
    if policy.is_last_stage():
        acc = alg.finish_accumulation(reduce)
        metrics.update(acc.metrics)
        scale = acc.grad_scale
    else:
        scale = 1.0
    scale = _broadcast_from_last_stage([scale])[0]
    if scale != 1.0:
        policy.model.scale_gradients(scale)
    metrics.update(policy.optimizer_step())
    reset = 0.0
    if policy.is_last_stage():
        decision = alg.after_optimizer_step(metrics)
        metrics.update(decision.metrics)
        reset = float(decision.reset_ewma)
    reset = _broadcast_from_last_stage([reset])[0]
    if ewma is not None:
        params = [p for p in policy.model.parameters()]
        if reset:
            ewma.reset(params)
            metrics["ewma_reset"] = 1.0
        else:
            ewma.update(params)
    return metrics
