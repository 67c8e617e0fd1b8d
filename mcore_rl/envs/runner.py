"""Run a batch of episodes concurrently against a RolloutEngine, turn by turn, appending token ids only.

Why an event loop and not one episode after another: every live episode has one request in the engine at a time,
so the engine batches the turns of all episodes together; as soon as some turns finish, their tool calls are run
in one pool batch and their next turns are submitted while the others still decode.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

from mcore_rl.data.records import PromptRecord
from mcore_rl.envs.base import Environment, Episode, Feedback, Message, Trajectory
from mcore_rl.envs.chat import TurnRenderer
from mcore_rl.envs.tool_calls import ToolCall, parse_tool_calls
from mcore_rl.envs.tools import ToolResult, ToolRunner, tool_message
from mcore_rl.rollout.protocol import GenerationRequest, RolloutEngine, Sample, SamplingParams

_rid_counter = itertools.count()


@dataclass
class _Live:
    """An episode in progress: the append-only token record and its counters."""

    episode: Episode
    rid: str
    ids: list[int]
    prompt_len: int
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    tool_calls: int = 0
    valid_tool_calls: int = 0
    tool_reasons: dict[str, int] = field(default_factory=dict)  # tool results by outcome (ok, timeout, ...)
    calls: list[ToolCall] = field(default_factory=list)  # this turn's calls, waiting for the pool
    feedback: Feedback | None = None
    termination: str | None = None
    reward: float = 0.0
    correct: bool = False

    def __post_init__(self) -> None:
        n = len(self.ids)
        self.mask, self.logprobs, self.versions = [0] * n, [0.0] * n, [-1] * n

    def append(self, ids: Sequence[int], policy: Sample | None = None) -> None:
        start = len(self.ids)
        self.ids.extend(ids)
        if policy is None:
            self.mask += [0] * len(ids)
            self.logprobs += [0.0] * len(ids)
            self.versions += [-1] * len(ids)
        else:
            self.mask += [1] * len(ids)
            self.logprobs += [float(x) for x in policy.output_logprobs]
            self.versions += [int(v) for v in policy.weight_versions]
            self.turn_spans.append((start, len(self.ids)))

    def finish(self, termination: str) -> None:
        self.termination = termination

    def trajectory(self) -> Trajectory:
        ep = self.episode
        return Trajectory(
            prompt_id=ep.record.prompt_id,
            sample_index=ep.sample_index,
            token_ids=self.ids,
            mask=self.mask,
            logprobs=self.logprobs,
            versions=self.versions,
            prompt_len=self.prompt_len,
            turn_spans=self.turn_spans,
            turn_rewards=self.turn_rewards,
            reward=self.reward,
            correct=self.correct,
            tool_calls=self.tool_calls,
            valid_tool_calls=self.valid_tool_calls,
            termination=self.termination or "abort",
            messages=ep.messages,
            metadata={
                "rid": self.rid,
                "attempts": ep.attempts,
                "tool_results": dict(self.tool_reasons),
                **ep.state,
            },
        )


class EpisodeRunner:
    """Drives `env` against `engine`. Reused across rounds: the tool pool stays warm."""

    def __init__(
        self, env: Environment, engine: RolloutEngine, renderer: TurnRenderer, tools: ToolRunner | None = None
    ) -> None:
        if env.tools and tools is None:
            tools = ToolRunner(
                env.tools,
                num_workers=env.config.tool_workers,
                timeout_s=env.config.tool_timeout_s,
                memory_limit_mb=env.config.tool_memory_limit_mb,
            )
        self.env, self.engine, self.renderer, self.tools = env, engine, renderer, tools
        self.cfg = env.config

    def run(
        self, records: Sequence[PromptRecord], sampling: SamplingParams, samples_per_prompt: int = 1
    ) -> list[Trajectory]:
        """One trajectory per (record, sample), record-major. `sampling` sets temperature / top-p / top-k / seed;
        max_new_tokens per turn is the env's, shrunk to the episode's remaining token budget."""
        lives = self.start(records, samples_per_prompt)
        self.advance(lives, sampling)
        return [live.trajectory() for live in lives]

    def start(self, records: Sequence[PromptRecord], samples_per_prompt: int = 1) -> list[_Live]:
        """The episodes of `records` before their first turn (record-major), each with its first prompt."""
        lives = []
        for rec in records:
            for j in range(samples_per_prompt):
                messages = self.env.start(rec)
                ids = self.renderer.prompt_ids(messages)
                if len(ids) + 1 >= self.cfg.max_total_tokens:
                    raise ValueError(
                        f"env.max_total_tokens={self.cfg.max_total_tokens} leaves no room after the "
                        f"{len(ids)}-token prompt of {rec.prompt_id!r}"
                    )
                rid = f"{rec.prompt_id}#{j}-{next(_rid_counter)}"
                lives.append(_Live(Episode(rec, j, messages), rid, ids, len(ids)))
        return lives

    def advance(self, lives: Sequence[_Live], sampling: SamplingParams) -> None:
        """Run every unfinished episode of `lives` until it terminates."""
        pending: dict[Future, int] = {}
        for i, live in enumerate(lives):
            if live.termination is None:
                pending[self._submit(live, sampling)] = i
        try:
            while pending:
                done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
                finished = sorted((pending.pop(f), f.result()) for f in done)
                self._advance(finished, lives)
                for i, _ in finished:
                    if lives[i].termination is None:
                        pending[self._submit(lives[i], sampling)] = i
        except BaseException:
            for i in pending.values():  # an environment or tool error: leave no turn decoding for nobody
                self.engine.abort(f"{lives[i].rid}/t{lives[i].episode.turn}")
            raise

    # ---- one turn ----------------------------------------------------------------------------------------
    def advance_in_waves(
        self, lives: Sequence[_Live], samplings: Sequence[SamplingParams], pause: Callable[[_Live], bool]
    ) -> None:
        """Like `advance` (episode i samples with `samplings[i]`), but in waves: the next turn of every live
        episode goes to the engine in ONE call and the wave waits for all of them, so the engine's batches do not
        depend on timing and a seeded run (and its resume) generates the same tokens. An episode for which
        `pause(live)` is true after a wave is left ready for its next turn (partial rollouts continue it later)."""
        active = [i for i, live in enumerate(lives) if live.termination is None]
        while active:
            futures = self.engine.submit([self._request(lives[i], samplings[i]) for i in active])
            try:
                self._advance([(i, f.result()) for i, f in zip(active, futures, strict=True)], lives)
            except BaseException:
                for i in active:  # leave no turn of this wave decoding for nobody
                    self.engine.abort(f"{lives[i].rid}/t{lives[i].episode.turn}")
                raise
            active = [i for i in active if lives[i].termination is None and not pause(lives[i])]

    def _submit(self, live: _Live, sampling: SamplingParams) -> Future:
        return self.engine.submit([self._request(live, sampling)])[0]

    def _request(self, live: _Live, sampling: SamplingParams) -> GenerationRequest:
        budget = self.cfg.max_total_tokens - len(live.ids)
        seed = _turn_seed(sampling.seed, live.episode)
        sp = SamplingParams(
            max_new_tokens=min(self.cfg.max_new_tokens, budget),
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=seed,
            stop_token_ids=sorted({*sampling.stop_token_ids, self.renderer.eot_id}),
        )
        live.episode.turn += 1
        # routing_key: every turn of an episode to the same server where a router allows it (sglang-router's
        # manual policy), so the episode's prefix is found in that server's cache
        return GenerationRequest(
            list(live.ids), sp, rid=f"{live.rid}/t{live.episode.turn}", metadata={"routing_key": live.rid}
        )

    def _advance(self, finished: list[tuple[int, Sample]], lives: Sequence[_Live]) -> None:
        """Append each finished turn, run all their tool calls in one pool batch, then ask the environment."""
        for i, sample in finished:
            self._close_turn(lives[i], sample)
        queued = [(i, c) for i, _ in finished for c in lives[i].calls]
        limit = self.cfg.max_tool_calls_per_turn
        runnable = [(i, c) for k, (i, c) in enumerate(queued) if _rank(queued, k) < limit]
        ran = dict(
            zip(
                ((i, id(c)) for i, c in runnable),
                self.tools.run([c for _, c in runnable]) if runnable and self.tools is not None else [],
            )
        )
        for i, _ in finished:
            live = lives[i]
            if live.termination is not None:
                continue
            if live.calls:
                results = [ran.get((i, id(c))) or ToolRunner.refused(c, limit) for c in live.calls]
                self._after_tools(live, results)
            else:
                self._after_reply(live)
            if live.termination is None:
                self._next_turn(live)

    def _close_turn(self, live: _Live, sample: Sample) -> None:
        live.calls, live.feedback = [], None
        out = list(sample.output_ids)
        live.append(out, policy=sample)
        live.turn_rewards.append(0.0)
        if sample.finish_reason == "abort":
            return live.finish("abort")
        closed = bool(out) and out[-1] == self.renderer.eot_id
        reply_ids = out[:-1] if closed else out
        reply = self.renderer.tok.decode(reply_ids, skip_special_tokens=False)
        live.episode.messages.append({"role": "assistant", "content": reply})
        if not closed:
            if sample.finish_reason == "length" and self.cfg.truncated_turn == "end":
                return live.finish("length")
            live.append([self.renderer.eot_id])  # the template's end of turn, written by us: mask 0
        if self.env.tools:
            live.calls = parse_tool_calls(reply, self.cfg.tool_format)
            live.tool_calls += len(live.calls)
            if live.calls and len(live.turn_spans) >= self.cfg.max_turns:
                live.calls = []  # no turn left to read the results: do not run them
                return live.finish("max_turns")

    def _after_tools(self, live: _Live, results: list[ToolResult]) -> None:
        for r in results:
            live.valid_tool_calls += int(r.ok)
            live.tool_reasons[r.reason] = live.tool_reasons.get(r.reason, 0) + 1
        live.feedback = Feedback(
            0.0,
            False,
            [tool_message(r) for r in results],
        )

    def _after_reply(self, live: _Live) -> None:
        live.episode.attempts += 1
        fb = self.env.respond(live.episode, live.episode.messages[-1]["content"])
        live.turn_rewards[-1] = float(fb.reward)
        live.feedback = fb
        if fb.done:
            live.reward, live.correct = float(fb.reward), bool(fb.correct)
            live.finish(fb.reason or "answered")

    def _next_turn(self, live: _Live) -> None:
        if len(live.turn_spans) >= self.cfg.max_turns:
            return live.finish("max_turns")
        messages: list[Message] = live.feedback.messages if live.feedback else []
        if not messages:
            raise ValueError(
                f"env {self.env.name!r}: respond() returned done=False without messages for the model"
            )
        cont = self.renderer.continuation_ids(messages)
        if len(live.ids) + len(cont) + 1 > self.cfg.max_total_tokens:
            return live.finish("max_total_tokens")
        live.episode.messages.extend(messages)
        live.append(cont)


def _turn_seed(seed: int | None, ep: Episode) -> int | None:
    """A distinct, reproducible seed per (prompt, sample, turn) of a seeded run; None stays None."""
    if seed is None:
        return None
    return seed + zlib.crc32(ep.record.prompt_id.encode()) + 7919 * ep.sample_index + 104729 * ep.turn


def _rank(queued: list[tuple[int, ToolCall]], k: int) -> int:
    """How many calls of the same episode come before call k (calls past the per-turn limit are refused)."""
    owner = queued[k][0]
    return sum(1 for i, _ in queued[:k] if i == owner)
