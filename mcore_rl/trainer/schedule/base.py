"""The schedule contract and the in-flight bookkeeping every schedule shares (rank 0 only).

A round is a list of requests (one per prompt, `samples_per_prompt` samples each) submitted to the engine together.
Rounds wait in `pending` until the loop consumes them. Every request remembers its prompt id and its seed, so the
schedule's state (`state_dict`) says exactly which prompts are in flight: a checkpoint keeps the samples of the
requests that had finished and the (prompt id, seed) of the others, and a resumed run regenerates exactly those -
no prompt skipped or repeated, and the data cursor stays where the uninterrupted run had it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mcore_rl.registry import Registry
from mcore_rl.rollout.protocol import GenerationRequest, Sample, SamplingParams
from mcore_rl.trainer.state import RunState

log = logging.getLogger("mcore_rl")

SCHEDULES: Registry[type[Schedule]] = Registry("algorithm.schedule", {
    "sync": "mcore_rl.trainer.schedule.sync", "staged": "mcore_rl.trainer.schedule.staged",
    "async": "mcore_rl.trainer.schedule.pipeline"})


def schedule_class(name: str) -> type[Schedule]:
    """The schedule registered as `name` (algorithm.schedule); its class is needed before the engine exists
    (`engine_options`), the instance after."""
    return SCHEDULES.get(name)


@dataclass
class ScheduleContext:
    """What a schedule works with. `engine`/`data` (the prompt source) exist on rank 0 only (None elsewhere):
    only rank 0 generates; every rank asks `updates_per_round` and `depth`."""

    algorithm: Any                  # the algorithm's config: schedule, updates_per_*, max_staleness, stale_policy
    trainer: Any                    # TrainerConfig: prompts/samples per update, sampling settings
    seed: int
    deterministic: bool
    state: RunState                 # read only: the round and weight version the trainer is at
    stop: Any                       # StopFlag: generation waits give up when a stop is requested
    engine: Any = None
    data: Any = None
    episodes: Any = None            # env=NAME: trainer.episodes.EpisodeLauncher (each sample is an episode)


@dataclass
class Generated:
    """A round ready for scoring: prompts and their samples (request-major, `samples_per_prompt` per prompt)."""

    index: int
    prompts: list
    samples: list[Sample]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class _Request:
    prompt: Any                          # trainer.prompts.Prompt
    seed: int
    rid: str
    futures: list[Future] | None = None  # in flight
    samples: list[Sample] | None = None  # finished (collected, or restored from a checkpoint)

    def finished(self) -> list[Sample] | None:
        """The request's samples once all are done and none was aborted (an aborted one is regenerated)."""
        if self.samples is None and self.futures is not None and all(f.done() for f in self.futures):
            if all(f.exception() is None for f in self.futures):
                got = [f.result() for f in self.futures]
                if all(s.finish_reason != "abort" for s in got):
                    self.samples = got
        return self.samples

    def result(self) -> list[Sample]:
        """The samples of a request whose futures are done (raises the engine's error, if any)."""
        return self.finished() or [f.result() for f in self.futures]


@dataclass
class _Round:
    index: int
    requests: list[_Request]

    def futures(self) -> list[Future]:
        return [f for r in self.requests if r.samples is None and r.futures for f in r.futures]


class Schedule:
    """Base: one round at a time (the sync schedule). Subclasses change depth and the hooks around training."""

    name: ClassVar[str] = ""
    depth: int = 0                       # rounds generated ahead of the one being consumed

    def __init__(self, ctx: ScheduleContext) -> None:
        self.ctx = ctx
        self.trainer, self.state, self.engine, self.data = ctx.trainer, ctx.state, ctx.engine, ctx.data
        self.deterministic = ctx.deterministic
        self.pending: deque[_Round] = deque()
        self.requeued: list = []          # prompts to generate again first (async stale_policy=requeue)
        self.next_index = 0               # round index of the next submission (seeds derive from it)

    # ---- what the loop asks ---------------------------------------------------------------------------
    @property
    def updates_per_round(self) -> int:
        return self.ctx.algorithm.updates_per_rollout

    @staticmethod
    def engine_options(options: dict) -> dict:
        """Engine constructor kwargs, adjusted for this schedule (staged: SGLang needs its memory saver)."""
        return options

    def before_train(self) -> None:
        """After scoring, before the old-log-prob pass and the updates."""

    def after_train(self) -> None:
        """After the round's updates, before the weight sync."""

    def before_sync(self) -> None:
        """Right before the weight sync (async: deterministic runs finish in-flight generation first)."""

    # ---- generation (rank 0) --------------------------------------------------------------------------
    def next_round(self, num_updates: int) -> Generated | None:
        """The oldest round, complete; None when a stop signal arrived first (everything in flight aborted)."""
        if not self.pending:
            self.next_index = max(self.next_index, self.state.round)
        self._fill(num_updates)
        rnd = self.pending[0]
        if not self._wait(rnd.futures()):
            self.abort(f"stop requested during generation: aborted round {rnd.index} "
                       f"({len(self.pending)} round(s) in flight)")
            return None
        self.pending.popleft()
        got = self._accept(rnd)
        if got.prompts:
            return got
        log.warning("round %d: every group was stale (%s); taking the next round", rnd.index, got.metrics)
        return self.next_round(num_updates)

    def extra(self, num_prompts: int, salt: int) -> Generated | None:
        """More samples now, for the round being consumed (DAPO dynamic sampling); None if stopped."""
        if self.deterministic and not self._wait(self._all_futures()):
            return None  # deterministic: the engine's batch never mixes this draw with timing-dependent work
        index = self.state.round
        rnd = _Round(index, self._requests(self.data.next_prompts(num_prompts), index, salt))
        self._submit([rnd])
        if not self._wait(rnd.futures()):
            self.engine.abort(None)
            return None
        return Generated(index, [r.prompt for r in rnd.requests], [s for r in rnd.requests for s in r.result()])

    def _accept(self, rnd: _Round) -> Generated:
        reqs = rnd.requests
        return Generated(rnd.index, [r.prompt for r in reqs], [s for r in reqs for s in r.result()])

    def _fill(self, num_updates: int) -> None:
        """Top `pending` up to depth + 1 rounds, all new rounds in ONE engine call (a deterministic batch)."""
        new = []
        while len(self.pending) + len(new) < self.depth + 1:
            n = num_updates * self.trainer.prompts_per_update
            prompts = self.requeued[:n]
            self.requeued = self.requeued[n:]
            if len(prompts) < n:
                per = self.trainer.prompts_per_update
                fresh = self.data.next_prompts(-(-(n - len(prompts)) // per) * per)
                prompts, spare = prompts + fresh[:n - len(prompts)], fresh[n - len(prompts):]
                self.requeued = spare + self.requeued
            new.append(_Round(self.next_index, self._requests(prompts, self.next_index)))
            self.next_index += 1
        if new:
            if self.deterministic:
                self._wait(self._all_futures())
            self._submit(new)
            self.pending.extend(new)

    def _requests(self, prompts: list, index: int, salt: int = 0) -> list[_Request]:
        base = (self.ctx.seed * 1_000_003 + index) * 10_007 + salt * 1_000_000_007
        tag = f"r{index}" + (f"x{salt}" if salt else "")
        return [_Request(p, base + i, f"{tag}-{i}") for i, p in enumerate(prompts)]

    def _submit(self, rounds: list[_Round]) -> None:
        t = self.trainer
        todo = [r for rnd in rounds for r in rnd.requests if r.samples is None]
        reqs = [GenerationRequest(prompt_ids=r.prompt.prompt_ids, rid=r.rid, sampling=SamplingParams(
            max_new_tokens=t.max_new_tokens, temperature=t.temperature, top_p=t.top_p, n=t.samples_per_prompt,
            seed=r.seed, stop_token_ids=self.data.stop_token_ids)) for r in todo]
        if not reqs:
            return
        if self.ctx.episodes is not None:  # every sample is a whole episode (trainer/episodes.py)
            futures = self.ctx.episodes.submit(reqs, [r.prompt for r in todo])
        else:
            futures = self.engine.submit(reqs)
        G = t.samples_per_prompt
        for i, r in enumerate(todo):
            r.futures = futures[i * G:(i + 1) * G]

    def _all_futures(self) -> list[Future]:
        return [f for rnd in self.pending for f in rnd.futures()]

    def _wait(self, futures: list[Future], poll_s: float = 0.2) -> bool:
        """Wait for `futures`; False as soon as a stop signal is requested. Through the engine, so an in-process
        engine decodes on this thread meanwhile (LocalEngine.wait says why)."""
        todo = list(futures)
        while todo:
            if self.ctx.stop.requested:
                return False
            self.engine.wait(todo, timeout=poll_s)
            todo = [f for f in todo if not f.done()]
        return True

    def abort(self, why: str | None = None) -> None:
        """Abort everything in flight. Finished requests keep their samples; the rest are regenerated after a
        resume (state_dict lists them), so the data cursor never moves back."""
        if not self.pending:
            return
        self.engine.abort(None)
        wait(self._all_futures(), timeout=120)
        if why:
            log.warning(why)

    def finished_samples(self) -> list[Sample]:
        """The finished, not yet consumed samples of the rounds in flight (the old-log-prob source scores them
        as they complete)."""
        out = []
        for rnd in self.pending:
            for r in rnd.requests:
                if r.futures is None:  # restored from a checkpoint: already collected
                    out.extend(r.samples or [])
                    continue
                out.extend(f.result() for f in r.futures if f.done() and not f.cancelled() and f.exception() is None)
        return out

    def close(self) -> None:
        self.abort()
        self.pending.clear()

    # ---- exact resume ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Which prompts are in flight: per round, per request the prompt id, seed and (if done) the samples."""
        return {"next_index": self.next_index,
                "requeued": [p.prompt_id for p in self.requeued],
                "pending": [{"index": rnd.index, "requests": [
                    {"prompt_id": r.prompt.prompt_id, "seed": r.seed, "rid": r.rid,
                     "samples": None if r.finished() is None else [dataclasses.asdict(s) for s in r.samples]}
                    for r in rnd.requests]} for rnd in self.pending]}

    def load_state_dict(self, state: dict) -> None:
        """Restore the in-flight rounds; requests without samples are submitted again with their own seeds."""
        lookup = self.data.lookup
        self.next_index = int(state["next_index"])
        self.requeued = [lookup(pid) for pid in state["requeued"]]
        self.pending = deque(_Round(int(rnd["index"]), [
            _Request(lookup(r["prompt_id"]), int(r["seed"]), r["rid"],
                     samples=None if r["samples"] is None else [Sample(**s) for s in r["samples"]])
            for r in rnd["requests"]]) for rnd in state["pending"])
        self._submit(list(self.pending))
        regen = sum(r.samples is None for rnd in self.pending for r in rnd.requests)
        if self.pending:
            log.warning("resumed %d round(s) in flight: %d request(s) restored finished, %d generated again",
                        len(self.pending), sum(len(rnd.requests) for rnd in self.pending) - regen, regen)
