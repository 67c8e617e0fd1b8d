"""One optimizer update: algorithm loss over micro-batches, exact global aggregation, optimizer step.

The algorithm's `token_weights` carry every global denominator (all-reduced over the data-parallel group), so the
summed micro-batch losses are the batch loss whatever the micro-batch or DP split. Only the last pipeline stage
sees the loss: step-level decisions (the deferred renormalisation scale, PPO-EWMA resets) are broadcast from it.

Before the optimizer step, every rank agrees (one all-reduce, see `NonFiniteGuard`) whether the loss and the
gradients are finite: Megatron's clipping lets NaN through without a grad scaler, so a non-finite update would
otherwise reach the weights, the engine and the checkpoints.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mcore_rl.agreement import FatalRunError, any_rank
from mcore_rl.algorithms import Algorithm, TokenBatch
from mcore_rl.batch import RolloutBatch
from mcore_rl.distributed import broadcast_floats, sum_reducer
from mcore_rl.faults import nan_at

log = logging.getLogger("mcore_rl")


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


# ---- non-finite guard (kept apart from the update itself) ------------------------------------------------------
def local_grad_norm(model) -> float:
    """This rank's gradient norm (Megatron DDP keeps gradients in `main_grad`)."""
    grads = []
    for p in model.parameters():
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        if g is not None:
            grads.append(g)
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).double()))


@dataclass
class NonFiniteGuard:
    """Skips updates whose loss or gradients are non-finite on any rank; stops the run after
    `max_consecutive` skips in a row (a diverged run, not a one-off overflow)."""

    max_consecutive: int = 3
    consecutive: int = 0
    total: int = 0

    def should_skip(self, model, metrics: dict[str, float], update_index: int | None) -> bool:
        """Collective: one all-reduce over all ranks. Updates the counters and `metrics` in place."""
        losses = [v for k, v in metrics.items() if k in ADDITIVE]
        bad = not all(math.isfinite(v) for v in losses) or not math.isfinite(local_grad_norm(model))
        skip = any_rank(bad)
        metrics["nonfinite_skipped"] = float(skip)
        if not skip:
            self.consecutive = 0
            return False
        self.consecutive += 1
        self.total += 1
        metrics["nonfinite_skipped_total"] = float(self.total)
        log.warning("update %s: non-finite loss or gradient on some rank (this rank: loss=%s); update skipped, "
                    "weights and optimizer state untouched (%d in a row)", update_index,
                    metrics.get("loss"), self.consecutive)
        if self.consecutive >= self.max_consecutive:
            raise FatalRunError(f"update {update_index}: {self.consecutive} consecutive non-finite updates "
                                f"(trainer.max_nonfinite_skips={self.max_consecutive}); stopping, the last "
                                f"checkpoint holds the last good weights")
        return True


def _loss_fn(alg: Algorithm, reduce, inject: bool, old_from_forward: bool = False):
    """The per-micro-batch loss Megatron's forward-backward calls: the algorithm's loss on the micro-batch's
    tokens (`inject`: the fault suite's NaN at this update; `old_from_forward`: old_logp is this forward's own
    log-probs, detached -- the anchor of a round's only update, `learner.reuses_old_logp`)."""

    def loss_fn(mb, logp, entropy):
        old = mb.extras.get("old_logp")
        if old is None and old_from_forward:
            old = logp.detach().float()
        tb = TokenBatch(
            logp=logp, mask=mb.loss_mask, advantages=mb.extras["adv"], rollout_logp=mb.extras["rollout_logp"],
            token_weight=mb.extras["w"], old_logp=old, prox_logp=mb.extras.get("prox_logp"),
            ref_logp=mb.extras.get("ref_logp"), entropy=entropy if alg.needs_entropy else None,
        )
        loss, metrics = alg.loss(tb, reduce)
        if inject:
            loss = loss * float("nan")
            metrics["loss"] = float("nan")
        if entropy is not None and "entropy" not in metrics:
            m = mb.loss_mask
            metrics["entropy"] = float((entropy.detach() * m).sum() / m.sum().clamp(min=1))
        return loss, metrics

    return loss_fn


def _after_step(policy, alg: Algorithm, metrics: dict[str, float], ewma) -> None:
    """The algorithm's post-step decision (from the last PP stage) and the EWMA weights' update or reset."""
    reset = 0.0
    if policy.is_last_stage():
        decision = alg.after_optimizer_step(metrics)
        metrics.update(decision.metrics)
        reset = float(decision.reset_ewma)
    reset = _broadcast_from_last_stage([reset])[0]
    if ewma is not None:
        params = list(policy.model.parameters())
        if reset:
            ewma.reset(params)
            metrics["ewma_reset"] = 1.0
        else:
            ewma.update(params)


def live_rows(alg: Algorithm, advantages: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
    """Rows to run forward/backward on, or None for all: the algorithm's inert rows left out (`inert_rows`), at
    least one row kept so that every rank still runs the update's collectives."""
    inert = alg.inert_rows(advantages, weights)
    if inert is None or not bool(inert.any()):
        return None
    live = (~inert).nonzero().flatten()
    return live if live.numel() else torch.zeros(1, dtype=torch.long)


def run_update(policy, alg: Algorithm, rb: RolloutBatch, advantages: torch.Tensor, keep: torch.Tensor,
               anchors: dict[str, torch.Tensor], temperature: float, ewma=None,
               guard: NonFiniteGuard | None = None, update_index: int | None = None,
               skip_inert_rows: bool = False, old_logp_from_forward: bool = False) -> dict[str, float]:
    """Train on this DP rank's rows `rb` of one mini-batch. `anchors`: old_logp / prox_logp / ref_logp [N, L].
    `guard`: skip the step when anything is non-finite; `update_index` (1-based) names it in logs;
    `skip_inert_rows`: leave rows with an exactly zero gradient out of the forward/backward (`live_rows`);
    `old_logp_from_forward`: `anchors` has no old_logp, the loss takes it from its own forward (detached)."""
    if old_logp_from_forward and alg.needs_step_logp:
        raise ValueError(f"algorithm {alg.name!r} reads old_logp over the whole batch before the first micro-batch: "
                         "it cannot come from the update's own forward (trainer.reuse_old_logp)")
    reduce = dp_reducer()
    weights = alg.token_weights(rb.loss_mask, rb.group_ids, reduce, keep)  # denominators over the whole batch
    adv_tok = advantages[:, None].float() * rb.loss_mask
    extras = {"adv": adv_tok, "rollout_logp": rb.rollout_logp, "w": weights.float(), **anchors}
    batch = rb.policy_batch(**extras)
    live = live_rows(alg, advantages, weights) if skip_inert_rows else None
    trained = {"trained_rows_frac": 1.0}
    if live is not None:
        trained["trained_rows_frac"] = live.numel() / max(len(batch), 1)
        batch = batch.select(live)
        batch.index = None  # a row subset of the update, not a micro-batch of it
    step_metrics = {}
    if policy.is_last_stage():  # whole-batch statistics of the anchors, no forward (PPO-EWMA's TI bounds); the
        # other PP stages hold zeros for them and compute no loss, and the DP group lies within one stage
        step_metrics = dict(alg.begin_update(anchors.get("old_logp"), anchors.get("prox_logp"), rb.rollout_logp,
                                             rb.loss_mask, reduce))
    if alg.needs_step_logp:  # e.g. P3O ess_scope=batch: whole-batch statistics before the first micro-batch
        logp = policy.logprobs(rb.policy_batch(), temperature)  # None off the last PP stage (it has no loss)
        if logp is not None:
            anchor = anchors["old_logp"] if alg.needs_old_logp else rb.rollout_logp
            step_metrics.update(alg.begin_step(logp, anchor, rb.loss_mask, reduce))
    policy.zero_grad()
    outs = policy.forward_backward(batch, _loss_fn(alg, reduce, nan_at(update_index), old_logp_from_forward),
                                   temperature, with_entropy=True)
    metrics = {**(mean_metrics(outs) if outs else {}), **step_metrics, **trained}
    if policy.is_last_stage():
        acc = alg.finish_accumulation(reduce)
        metrics.update(acc.metrics)
        scale = acc.grad_scale
    else:
        scale = 1.0
    scale = _broadcast_from_last_stage([scale])[0]
    if scale != 1.0:
        policy.model.scale_gradients(scale)
    if guard is not None and guard.should_skip(policy.model, metrics, update_index):
        metrics.update({"grad_norm": float("nan"), "update_ok": 0.0})
        return metrics
    metrics.update(policy.optimizer_step())
    _after_step(policy, alg, metrics, ewma)
    return metrics
