"""Partial rollouts (`partial_rollout.enabled`, slime's `--partial-rollout`): a round over-issues prompts, stops
generating once it holds enough complete groups, and carries the unfinished samples, their tokens kept, into the
next round, where they continue instead of restarting.

How a round runs (rank 0): the pool is the carried groups (oldest first) plus fresh prompts up to
`ceil(over_issue x groups needed)`. Generation goes in chunks: every unfinished sample generates at most
`chunk_tokens` more tokens (an episode: whole turns until it produced that many policy tokens), then the round
checks whether `groups needed` groups are complete; if so it stops, else the next chunk runs (at least one chunk
runs every round: what is in flight keeps generating while finished groups wait). A chunk boundary is
the deterministic stand-in for slime's "abort when the batch is full", so a seeded run and its resume agree token
for token. The first complete groups in pool order train; every other group (unfinished, or complete but surplus)
is carried. A group whose oldest token lags the trainer by `max_age` versions generates to its end in the round.

Every sample has one id for its whole life (`<group id>#<j>`); `run.dir/partial.jsonl` lists per round the ids
issued, trained and carried, and the carried groups are the schedule's checkpoint state, so no sample is lost or
trained twice across a kill and resume. Old-logit sources that need one version per turn (`interrupt`,
`old_logit_model`) get it: a carried single-turn sample with tokens of an earlier version restarts from its prompt
(its tokens dropped, counted in `partial/restarted_tokens`); a carried episode keeps its finished turns, each of
one version. `partial_rollout.mask_stale` takes earlier-version tokens out of the loss (trainer/rounds.py).
"""

from __future__ import annotations

import json
import logging
import math
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from mcore_rl.config import PartialRolloutConfig
from mcore_rl.rollout.protocol import SamplingParams
from mcore_rl.trainer.carried import Continuation, EpisodePart, Group, new_group
from mcore_rl.trainer.schedule import Generated, Schedule
from mcore_rl.trainer.setup import ConfigError

log = logging.getLogger("mcore_rl")


class PartialSchedule:
    """Wraps the run's schedule (sync or staged): generation is this class's, the hooks around training (staged:
    the engine's memory) are the wrapped schedule's. `depth` includes `max_age`: the old-logit sources keep the
    versions a carried token may still need."""

    def __init__(
        self, inner: Schedule, cfg: PartialRolloutConfig, run_dir: Path | None, restart: bool
    ) -> None:
        if inner.depth > 0:
            raise ConfigError(
                f"partial_rollout.enabled=true needs algorithm.schedule sync or staged, not "
                f"{inner.name!r} (async rounds are generated ahead; carried samples are not)"
            )
        if inner.ctx.algorithm.dynamic_sampling:
            raise ConfigError(
                "partial_rollout.enabled=true and algorithm.dynamic_sampling=true: choose one "
                "(both decide which groups a round trains on)"
            )
        self.inner, self.cfg, self.restart = inner, cfg, restart
        self.depth = inner.depth + cfg.max_age
        self.carried: list[Group] = []
        self.spare: list = []  # prompts drawn (the data source draws whole batches) but not issued yet
        self.issued = 0
        self.log_path = run_dir / "partial.jsonl" if run_dir is not None else None
        self._pool: ThreadPoolExecutor | None = None

    def __getattr__(self, name: str) -> Any:  # updates_per_round, before_train, after_train, before_sync, ...
        return getattr(self.inner, name)

    @property
    def runner(self) -> Any:
        """The episode runner of env=NAME runs (None for single-turn prompts)."""
        eps = self.inner.ctx.episodes
        return eps.runner if eps is not None else None

    # ---- a round ------------------------------------------------------------------------------------------
    def next_round(self, num_updates: int) -> Generated | None:
        t, version, rnd = self.inner.trainer, self.inner.state.version, self.inner.state.round + 1
        need = num_updates * t.prompts_per_update
        self._top_up(math.ceil(self.cfg.over_issue * need), rnd)
        restarted = sum(p.restart() for g in self.carried for p in g.parts if self._restarts(p, version))
        chunks = 0
        while (todo := [g for g in self.carried if not g.complete]) and (
            chunks == 0 or sum(g.complete for g in self.carried) < need
        ):  # at least one chunk: what is in flight generates while the finished groups wait to train
            if not self._chunk(todo, version):
                self.inner.engine.abort(None)
                log.warning(
                    "stop requested during generation: round %d aborted (%d groups carried)",
                    rnd,
                    len(self.carried),
                )
                return None
            chunks += 1
        batch = [g for g in self.carried if g.complete][:need]
        chosen = {id(g) for g in batch}
        self.carried = [g for g in self.carried if id(g) not in chosen]
        samples = [s for g in batch for s in g.samples(self.inner.data.tokenizer)]
        metrics = self._metrics(batch, samples, version, rnd, chunks, restarted)
        self._log(rnd, batch)
        return Generated(rnd, [g.prompt for g in batch], samples, metrics)

    def _restarts(self, part: Any, version: int) -> bool:
        return (self.restart and isinstance(part, Continuation) and not part.finished
                and any(v < version for v in part.versions))  # fmt: skip

    def _top_up(self, want: int, rnd: int) -> None:
        """Fresh groups until the pool holds `want` (the data cursor moves by whole batches; the rest waits)."""
        n = max(0, want - len(self.carried))
        per = self.inner.trainer.prompts_per_update
        if len(self.spare) < n:
            self.spare += self.inner.data.next_prompts(-(-(n - len(self.spare)) // per) * per)
        fresh, self.spare = self.spare[:n], self.spare[n:]
        base = (self.inner.ctx.seed * 1_000_003 + rnd) * 10_007
        G = self.inner.trainer.samples_per_prompt
        for i, prompt in enumerate(fresh):
            self.carried.append(new_group(f"g{self.issued}", prompt, base + i, rnd, G, self.runner))
            self.issued += 1

    def _cap(self, g: Group, version: int) -> int:
        """No cap for a group `max_age` versions (or rounds: a restarted sample has no old tokens) old."""
        old = max(g.age(version), self.inner.state.round + 1 - g.born) >= self.cfg.max_age
        return 0 if old else self.cfg.chunk_tokens

    def _chunk(self, groups: list[Group], version: int) -> bool:
        """One chunk for every unfinished sample of `groups`; False when a stop was requested (nothing kept)."""
        if self.runner is not None:
            return self._episode_chunk(groups, version)
        t = self.inner.trainer
        sp = {
            "temperature": t.temperature,
            "top_p": t.top_p,
            "stop_token_ids": self.inner.data.stop_token_ids,
        }
        todo = [(p, self._cap(g, version)) for g in groups for p in g.parts if not p.finished]
        futures = self.inner.engine.submit([p.request(cap, t.max_new_tokens, sp) for p, cap in todo])
        if not self.inner._wait(futures):
            return False
        for (p, _), f in zip(todo, futures, strict=True):
            p.apply(f.result(), t.max_new_tokens)
        return True

    def _episode_chunk(self, groups: list[Group], version: int) -> bool:
        """The unfinished episodes advance in waves of turns (one engine call per wave: deterministic batches); an
        episode pauses at the first turn boundary after `chunk_tokens` policy tokens in this chunk."""
        t = self.inner.trainer
        parts, samplings, start, cap = [], [], {}, {}
        for g in groups:
            sp = SamplingParams(temperature=t.temperature, top_p=t.top_p, seed=g.seed,
                                stop_token_ids=list(self.inner.data.stop_token_ids))  # fmt: skip
            for p in g.parts:
                if not p.finished:
                    parts.append(p)
                    samplings.append(sp)
                    start[id(p.live)], cap[id(p.live)] = p.policy_tokens, self._cap(g, version)
        saved = [p.state() for p in parts]

        def pause(lv: Any) -> bool:
            return cap[id(lv)] > 0 and sum(lv.mask) - start[id(lv)] >= cap[id(lv)]

        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="partial")
        future = self._pool.submit(self.runner.advance_in_waves, [p.live for p in parts], samplings, pause)
        if not self.inner._wait([future]):
            self.inner.engine.abort(None)
            wait([future], timeout=120)
            for p, st in zip(
                parts, saved, strict=True
            ):  # aborted turns ended episodes: restore the chunk's start
                p.live = EpisodePart.from_state(st, _Record(p.live.episode.record)).live
            return False
        future.result()
        return True

    # ---- what a round reports -----------------------------------------------------------------------------
    def _metrics(self, batch: list[Group], samples: list, version: int, rnd: int, chunks: int,
                 restarted: int) -> dict[str, float]:  # fmt: skip
        ages = [g.age(version) for g in batch for _ in g.parts]
        stale = sum(
            v < version for s in samples for v, m in zip(s.weight_versions, _mask(s), strict=True) if m
        )
        unfinished = [p for g in self.carried for p in g.parts if not p.finished]
        return {
            "partial/carried_groups": float(len(self.carried)),
            "partial/carried_samples": float(len(unfinished)),
            "partial/carried_tokens": float(sum(len(p.out) for p in unfinished)),
            "partial/trained_carried_samples": float(sum(len(g.parts) for g in batch if g.born < rnd)),
            "partial/age_max": float(max(ages, default=0)),
            "partial/age_mean": float(sum(ages) / max(1, len(ages))),
            "partial/stale_tokens": float(stale),
            "partial/chunks": float(chunks),
            "partial/restarted_tokens": float(restarted),
        }

    def _log(self, rnd: int, batch: list[Group]) -> None:
        if self.log_path is None:
            return
        issued = sorted((g for g in batch + self.carried if g.born == rnd), key=lambda g: int(g.gid[1:]))
        rec = {
            "round": rnd,
            "issued": [g.gid for g in issued],  # from the groups: also right after a stop aborted this round
            "trained": [p.sid for g in batch for p in g.parts],
            "trained_born": [g.born for g in batch for _ in g.parts],
            "trained_prompts": [g.prompt.prompt_id for g in batch],
            "carried": [p.sid for g in self.carried for p in g.parts],
        }
        with open(self.log_path, "a") as f:  # a resumed run appends: the last record of a round counts
            f.write(json.dumps(rec) + "\n")

    # ---- the loop's other questions -----------------------------------------------------------------------
    def finished_samples(self) -> list:
        """Finished, not yet trained samples (old_logit_model scores them at their version)."""
        return [
            p.sample(g.gid, self.inner.data.tokenizer) for g in self.carried for p in g.parts if p.finished
        ]

    def extra(self, num_prompts: int, salt: int) -> Generated | None:
        raise RuntimeError("partial rollouts do not draw extra prompts (dynamic sampling is refused)")

    def abort(self, why: str | None = None) -> None:
        if self.inner.engine is not None:
            self.inner.engine.abort(None)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self.inner.close()

    # ---- exact resume -------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"issued": self.issued, "spare": [p.prompt_id for p in self.spare],
                "carried": [g.state() for g in self.carried]}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        lookup = self.inner.data.lookup
        self.issued = int(state["issued"])
        self.spare = [lookup(pid) for pid in state["spare"]]
        self.carried = [Group.from_state(g, lookup) for g in state["carried"]]
        if self.carried:
            log.warning(
                "resumed %d carried group(s) (%d unfinished samples)",
                len(self.carried),
                sum(not p.finished for g in self.carried for p in g.parts),
            )


class _Record:
    """An EpisodePrompt-shaped holder of a record (restoring an episode in place)."""

    def __init__(self, record: Any) -> None:
        self.record = record


def _mask(s: Any) -> list[int]:
    return s.output_mask if s.output_mask is not None else [1] * len(s.output_ids)
