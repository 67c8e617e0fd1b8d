"""Rank 0's side of a round: the schedule's samples, their rewards, and DAPO dynamic sampling.

Dynamic sampling (`algorithm.dynamic_sampling`, DAPO): a group whose G rewards are all equal has zero advantage and
teaches nothing. The round is over-sampled - more prompts drawn from the data and generated now - until it holds
the requested number of groups with non-zero reward variance, or `max_sampling_rounds` draws (the first included)
were made. Extra non-zero-variance groups are discarded; when the cap is hit, the batch is filled up with
zero-variance groups so every update keeps its size (`filter_zero_variance` removes them from the loss).
Metrics: `dynamic_sampling_rounds` (draws used) and `zero_variance_groups` (in the batch that trains).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from mcore_rl.agreement import FatalRunError
from mcore_rl.batch import RolloutBatch, build_rollout_batch
from mcore_rl.distributed import broadcast_object
from mcore_rl.envs.batch import summary_metrics
from mcore_rl.rewards.base import record_dict, score_with_records, step_metrics, uses_text
from mcore_rl.trainer.reward_service import session as rm_session
from mcore_rl.trainer.schedule import Generated, Schedule
from mcore_rl.trainer.state import RunState


@dataclass
class Round:
    """A scored round as every rank receives it: the batch, its rollout metrics, and the prompts behind it."""

    batch: RolloutBatch
    metrics: dict[str, float]
    prompt_ids: list[str]


def _groups(gen: Generated, rewards: list[float], correct: list[bool], G: int) -> list[tuple]:
    return [(p, gen.samples[i * G:(i + 1) * G], rewards[i * G:(i + 1) * G], correct[i * G:(i + 1) * G])
            for i, p in enumerate(gen.prompts)]


def _varies(group: tuple) -> bool:
    return max(group[2]) != min(group[2])


class Rounds:
    """Rank 0 takes the schedule's next round, scores it and broadcasts it; the other ranks pass None for the
    rank-0 parts (schedule generation, data, reward, compute meter, engine) and only receive."""

    def __init__(self, schedule: Schedule, rank: int, samples_per_prompt: int, prompts_per_update: int,
                 algorithm_config: Any, data: Any = None, reward_fn: Any = None, compute: Any = None,
                 engine: Any = None, scoring_passes: int = 0, episodes: bool = False,
                 mask_stale: bool = False, rm_service: Any = None) -> None:
        self.schedule, self.rank, self.G, self.per_update = schedule, rank, samples_per_prompt, prompts_per_update
        self.dynamic_sampling = algorithm_config.dynamic_sampling
        self.max_sampling_rounds = algorithm_config.max_sampling_rounds
        self.data, self.reward_fn, self.compute, self.engine = data, reward_fn, compute, engine
        self.scoring_passes = scoring_passes  # trainer forwards per sample besides the update (compute meter)
        self.episodes = episodes  # samples are environment episodes: rewards and episode metrics come with them
        self.mask_stale = mask_stale  # partial rollouts: tokens of an earlier version leave the loss
        self._by_id: dict | None = None  # prompt id -> its PromptRecord (the records rewards receive)
        # reward.rm.placement=trainer: the other ranks join its forwards meanwhile
        self.rm_service = rm_service

    def next(self, num_updates: int, state: RunState) -> Round | None:
        """The next round on every rank; None when a stop signal (Slurm preemption) arrived during generation:
        the schedule aborted what was in flight and its state lists those prompts for the resumed run."""
        payload = None
        if self.rank == 0:
            try:
                with rm_session(self.rm_service):  # closed before the broadcast below, whatever happens
                    payload = self._produce(num_updates)
            except FatalRunError as e:  # every rank must stop, not wait in the broadcast below
                payload = str(e)
        elif self.rm_service is not None:
            self.rm_service.serve()  # trainer/reward_service.py: until rank 0 has scored the round
        payload = broadcast_object(payload)
        if isinstance(payload, str):
            raise FatalRunError(payload)
        if payload is None:
            return None
        samples = payload["samples"]
        rb = build_rollout_batch(samples, payload["rewards"], payload["correct"],
                                 [i // self.G for i in range(len(samples))], pad_id=0)
        metrics = self._metrics(rb, payload["metrics"], state.version)
        if self.mask_stale:
            metrics["partial/masked_stale_tokens"] = float(mask_stale_tokens(rb, state.version))
        return Round(rb, metrics, [p.prompt_id for p in payload["prompts"]])

    def _metrics(self, rb: RolloutBatch, rank0: dict[str, float] | None, version: int) -> dict[str, float]:
        lengths = rb.response_len
        metrics = {
            "reward_mean": rb.rewards.mean().item(), "reward_std": rb.rewards.std().item() if len(rb) > 1 else 0.0,
            "accuracy": rb.correct.mean().item(), "response_len": lengths.mean().item(),
            "response_len_max": lengths.max().item(), "truncation_rate": rb.truncated.mean().item(),
            "rollout_tokens": lengths.sum().item(), "weight_version": float(version),
        }
        tok_versions = rb.versions[rb.loss_mask > 0].double()
        if tok_versions.numel():  # per-token lag behind the trainer: a weight update mid-sample shows here
            metrics["staleness_max"] = float(version - tok_versions.min().item())
            metrics["staleness_mean"] = float(version - tok_versions.mean().item())
        if self.rank == 0:
            metrics.update(rank0 or {})
            metrics.update(self.data.metrics())
            if hasattr(self.engine, "fault_metrics"):  # SGLang: HTTP retries, stale samples dropped, restarts
                metrics.update(self.engine.fault_metrics())
            if hasattr(self.engine, "speed_metrics"):  # the embedded engine: decode against its roofline
                metrics.update(self.engine.speed_metrics())
        return metrics

    def _score(self, gen: Generated) -> tuple[list[float], list[bool], dict[str, float]]:
        """Score a round's samples; feeds the pass-rate history and the compute meter."""
        G = self.G
        if self.episodes:  # env=NAME: the environment rewarded each episode (trainer/episodes.py)
            eps = [s.metadata["episode"] for s in gen.samples]
            rewards, correct = [float(e["reward"]) for e in eps], [bool(e["correct"]) for e in eps]
            self.compute.add_round([(len(s.prompt_ids), len(s.output_ids)) for s in gen.samples],
                                   self.scoring_passes)  # fmt: skip
            return rewards, correct, {}
        prompts = [p for p in gen.prompts for _ in range(G)]
        records = self._records(prompts, gen.samples)
        results = score_with_records(self.reward_fn, [s.text or "" for s in gen.samples],
                                     [p.answer for p in prompts], records)
        rewards, correct = [r.score for r in results], [bool(r.correct) for r in results]
        self.data.observe([p.prompt_id for p in prompts], rewards)
        self.compute.add_round([(len(s.prompt_ids), len(s.output_ids)) for s in gen.samples], self.scoring_passes)
        return rewards, correct, step_metrics(self.reward_fn, results)

    def _records(self, prompts: list, samples: list) -> list[dict]:
        """Each sample's prompt record as a plain dict (what a reward function or service gets). A reward that
        `uses_text` also gets `prompt_text` (the templated prompt) and `query` (prompt and response tokens decoded
        with special tokens kept: OpenRLHF's query)."""
        if self._by_id is None:
            self._by_id = {r.prompt_id: r for r in getattr(self.data, "train", None) or []}
        base = {p.prompt_id: record_dict(self._by_id.get(p.prompt_id, p)) for p in prompts}
        if not uses_text(self.reward_fn):
            return [base[p.prompt_id] for p in prompts]
        tok = self.data.tokenizer
        return [{**base[p.prompt_id], "prompt_text": tok.decode(s.prompt_ids, skip_special_tokens=False),
                 "query": tok.decode([*s.prompt_ids, *s.output_ids], skip_special_tokens=False)}
                for p, s in zip(prompts, samples)]

    def _produce(self, num_updates: int) -> dict | None:
        gen = self.schedule.next_round(num_updates)
        if gen is None:
            return None
        t0 = time.perf_counter()
        rewards, correct, metrics = self._score(gen)
        metrics.update(gen.metrics)
        groups = _groups(gen, rewards, correct, self.G)
        if self.dynamic_sampling:
            groups, metrics["dynamic_sampling_rounds"] = self._fill_varied(groups, len(groups))
        metrics["zero_variance_groups"] = float(sum(not _varies(g) for g in groups))
        if self.episodes:  # the episodes that train (after dynamic sampling's selection)
            metrics.update(summary_metrics([s.metadata["episode"] for g in groups for s in g[1]]))
        metrics["time_reward"] = time.perf_counter() - t0
        return {"index": gen.index, "prompts": [g[0] for g in groups], "samples": [s for g in groups for s in g[1]],
                "rewards": [r for g in groups for r in g[2]], "correct": [c for g in groups for c in g[3]],
                "metrics": metrics}

    def _fill_varied(self, groups: list[tuple], want: int) -> tuple[list[tuple], float]:
        varied = [g for g in groups if _varies(g)]
        flat = [g for g in groups if not _varies(g)]
        draws, per = 1, self.per_update
        while len(varied) < want and draws < self.max_sampling_rounds:
            extra = self.schedule.extra(-(-(want - len(varied)) // per) * per, salt=draws)
            if extra is None:  # stop signal: train on what we have, the loop stops after this round
                break
            draws += 1
            rewards, correct, _ = self._score(extra)
            for g in _groups(extra, rewards, correct, self.G):
                (varied if _varies(g) else flat).append(g)
        chosen = varied[:want]
        return chosen + flat[:want - len(chosen)], float(draws)


def mask_stale_tokens(rb: RolloutBatch, version: int) -> int:
    """`partial_rollout.mask_stale`: policy tokens generated before `version` (a carried sample's earlier rounds)
    get loss-mask 0 in place; every other entry of the mask is left as it was. Returns how many were masked."""
    stale = (rb.loss_mask > 0) & (rb.versions >= 0) & (rb.versions < version)
    rb.loss_mask[stale] = 0.0
    return int(stale.sum().item())


class PromptsLog:
    """`prompts.jsonl` (rank 0): per optimizer update, the round and the prompt ids it trained on. A resumed run
    appends; the last record per update is what the run finally trained on."""

    def __init__(self, path, enabled: bool = True) -> None:
        self.path, self._f = path, None
        self.enabled = enabled

    def log(self, update: int, record: dict) -> None:
        if not self.enabled:
            return
        import json

        if self._f is None:
            self._f = open(self.path, "a")  # noqa: SIM115 (kept open for the run)
        self._f.write(json.dumps({"update": update, **record}) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
