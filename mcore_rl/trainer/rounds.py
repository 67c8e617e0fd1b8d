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

from mcore_rl.rewards.base import failure_counts
from mcore_rl.trainer.schedule import Generated


def reward_round(run, gen: Generated) -> tuple[list[float], list[bool], dict[str, float]]:
    """Score a round's samples (rank 0); feeds the pass-rate history and the compute meter."""
    G = run.cfg.trainer.samples_per_prompt
    results = run.reward_fn.score([s.text or "" for s in gen.samples], [p.answer for p in gen.prompts for _ in range(G)])
    rewards, correct = [r.score for r in results], [bool(r.correct) for r in results]
    run.data.observe([p.prompt_id for p in gen.prompts for _ in range(G)], rewards)
    passes = int(run.algorithm.needs_old_logp) + int(run.ref is not None) + int(run.ewma is not None)
    run.compute.add_round([(len(s.prompt_ids), len(s.output_ids)) for s in gen.samples], passes)
    return rewards, correct, failure_counts(results)


def _groups(gen: Generated, rewards: list[float], correct: list[bool], G: int) -> list[tuple]:
    return [(p, gen.samples[i * G:(i + 1) * G], rewards[i * G:(i + 1) * G], correct[i * G:(i + 1) * G])
            for i, p in enumerate(gen.prompts)]


def _varies(group: tuple) -> bool:
    return max(group[2]) != min(group[2])


def produce(run, num_updates: int) -> dict | None:
    """The next round, scored (rank 0). None when a stop signal aborted generation."""
    gen = run.schedule.next_round(num_updates)
    if gen is None:
        return None
    t0 = time.perf_counter()
    rewards, correct, metrics = reward_round(run, gen)
    metrics.update(gen.metrics)
    G, ac = run.cfg.trainer.samples_per_prompt, run.algorithm.config
    groups = _groups(gen, rewards, correct, G)
    if ac.dynamic_sampling:
        groups, metrics["dynamic_sampling_rounds"] = _fill_varied(run, groups, len(groups), ac.max_sampling_rounds)
    metrics["zero_variance_groups"] = float(sum(not _varies(g) for g in groups))
    metrics["time_reward"] = time.perf_counter() - t0
    return {"index": gen.index, "prompts": [g[0] for g in groups], "samples": [s for g in groups for s in g[1]],
            "rewards": [r for g in groups for r in g[2]], "correct": [c for g in groups for c in g[3]],
            "metrics": metrics}


def _fill_varied(run, groups: list[tuple], want: int, max_rounds: int) -> tuple[list[tuple], float]:
    G, per = run.cfg.trainer.samples_per_prompt, run.cfg.trainer.prompts_per_update
    varied = [g for g in groups if _varies(g)]
    flat = [g for g in groups if not _varies(g)]
    draws = 1
    while len(varied) < want and draws < max_rounds:
        extra = run.schedule.extra(-(-(want - len(varied)) // per) * per, salt=draws)
        if extra is None:  # stop signal: train on what we have, the loop stops after this round
            break
        draws += 1
        rewards, correct, _ = reward_round(run, extra)
        for g in _groups(extra, rewards, correct, G):
            (varied if _varies(g) else flat).append(g)
    chosen = varied[:want]
    return chosen + flat[:want - len(chosen)], float(draws)


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
