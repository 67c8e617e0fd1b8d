"""The trainer's side of a round on every rank: the anchors (old / reference log-probs) the loss compares against,
and the round's optimizer updates, each on this data-parallel rank's share of its prompt groups."""

from __future__ import annotations

import time
from typing import Any

import torch

from mcore_rl.algorithms import Algorithm
from mcore_rl.batch import RolloutBatch, update_rows
from mcore_rl.oldlogp.base import OldLogpSource
from mcore_rl.trainer.rounds import PromptsLog
from mcore_rl.trainer.update import NonFiniteGuard, run_update


def _last_stage(logp: torch.Tensor | None, rb: RolloutBatch) -> torch.Tensor:
    """Log-probs exist on the last PP stage only; other stages get zeros (they never evaluate the loss)."""
    return logp if logp is not None else torch.zeros_like(rb.rollout_logp)


class Learner:
    """`ref`: the frozen reference policy (KL); `ewma`: PPO-EWMA's proximal weights; `oldlogp`: the old-log-prob
    source (mcore_rl/oldlogp) the algorithm's `old_logp_source` names; `reuse_old_logp` (decided once by
    `reuses_old_logp`): old_logp comes from each update's own forward, not from a scoring pass."""

    def __init__(
        self,
        policy: Any,
        algorithm: Algorithm,
        oldlogp: Any,
        guard: NonFiniteGuard,
        temperature: float,
        dp: int,
        dp_rank: int,
        prompts_log: PromptsLog,
        ref: Any = None,
        ewma: Any = None,
        skip_inert_rows: bool = False,
        reuse_old_logp: bool = False,
    ) -> None:
        self.policy, self.algorithm, self.oldlogp, self.guard = policy, algorithm, oldlogp, guard
        self.temperature, self.dp, self.dp_rank, self.prompts_log = temperature, dp, dp_rank, prompts_log
        self.ref, self.ewma, self.skip_inert_rows = ref, ewma, skip_inert_rows
        self.reuse_old_logp = reuse_old_logp

    def anchors(self, rb: RolloutBatch, version: int) -> dict[str, torch.Tensor]:
        """old_logp (from the source; None = anchor on the engine's rollout log-probs) and ref_logp, whole round."""
        out: dict[str, torch.Tensor] = {}
        if not self.reuse_old_logp:
            old = self.oldlogp.old_logp(rb, version)
            if old is not None or self.algorithm.needs_old_logp:
                out["old_logp"] = _last_stage(old, rb)
        if self.ref is not None:
            out["ref_logp"] = _last_stage(self.ref.logprobs(rb.policy_batch(), self.temperature), rb)
        return out

    def skipped_lengths(self, rb: RolloutBatch, adv: Any) -> list[tuple[int, int]]:
        """(prompt, response) lengths of the round's rows that every update left out (inert on every DP rank
        alike: the property is per row), for the compute meter. Empty when nothing is skipped."""
        if not self.skip_inert_rows:
            return []
        weights = self.algorithm.token_weights(rb.loss_mask, rb.group_ids, keep=adv.keep)  # whole round: global
        inert = self.algorithm.inert_rows(adv.advantages, weights)
        if inert is None or bool(inert.all()):  # all inert: the updates still run a row each; counted in full
            return []
        total = rb.policy_batch().lengths()
        return [(int(total[i]) - int(rb.response_len[i]), int(rb.response_len[i])) for i in inert.nonzero().flatten()]

    def _prox_logp(self, rb: RolloutBatch) -> torch.Tensor:
        """PPO-EWMA: proximal log-probs under the current EWMA weights."""
        with self.ewma.swapped_in(list(self.policy.model.parameters())):
            logp = self.policy.logprobs(rb.policy_batch(), self.temperature)
        return _last_stage(logp, rb)

    def update(
        self,
        rb: RolloutBatch,
        adv: Any,
        anchors: dict[str, torch.Tensor],
        u: int,
        n_up: int,
        update_index: int,
        round_index: int,
        prompt_ids: list[str],
    ) -> dict[str, float]:
        """Optimizer update `u` of the round's `n_up` (`update_index`, 1-based, names it in logs and prompts.jsonl)."""
        rows = update_rows(rb.group_ids, n_up, u, self.dp, self.dp_rank)
        part = {k: v[rows] for k, v in anchors.items()}
        t0 = time.perf_counter()
        if self.ewma is not None:
            part["prox_logp"] = self._prox_logp(rb.select(rows))
        metrics = run_update(
            self.policy,
            self.algorithm,
            rb.select(rows),
            adv.advantages[rows],
            adv.keep[rows],
            part,
            self.temperature,
            self.ewma,
            guard=self.guard,
            update_index=update_index,
            skip_inert_rows=self.skip_inert_rows,
            old_logp_from_forward=self.reuse_old_logp,
        )
        metrics["time_train"] = time.perf_counter() - t0
        per = -(
            -len(set(rb.group_ids.tolist())) // n_up
        )  # which prompts it trained on: resumes compare these
        self.prompts_log.log(
            update_index, {"round": round_index, "prompt_ids": prompt_ids[u * per : (u + 1) * per]}
        )
        return metrics


def reuses_old_logp(enabled: bool, source: OldLogpSource, algorithm: Algorithm, updates_per_round: int, policy: Any) -> bool:
    """Whether the update's own forward may stand in for the old-log-prob pass (`trainer.reuse_old_logp`).

    Why it is the same anchor: the source scores the round with the live weights before its first update, and a
    round of one update runs its forward with exactly those weights over every token its loss reads (it may
    group them into other micro-batches: equal up to rounding).
    What rules it out: a source that is not the live weights (snapshot, rollout, ...) or is audited; more than one
    update per round (the second update's weights have moved); statistics over the whole batch before the first
    micro-batch (P3O's batch ESS reads old_logp there); a training forward that differs from the scoring one
    (LoRA dropout)."""
    return (enabled and algorithm.needs_old_logp and source.reusable and updates_per_round == 1
            and not algorithm.needs_step_logp and policy.cfg.lora.dropout == 0)
