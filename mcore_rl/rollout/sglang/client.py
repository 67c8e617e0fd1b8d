"""Asyncio HTTP client for SGLang servers (or sglang-router in front of them).

This module is generation: /generate goes one request per sample through a router (its request type takes ONE
prompt; a list answers 422) and batched straight to workers (faster). The HTTP transport (session, retries, payload
checks) is transport.py; abort/pause/memory/health calls are control.py; weight updates weight_session.py.

Stale samples: a sample whose tokens carry a weight version older than the client's version when generate() was
called came from a server that lost its weights (a restarted worker still on the initial model). It is dropped
and generated again; `stats` counts drops and HTTP retries so the trainer can log them.

Interrupt mode (`interrupts.enabled`, old_logp_source=interrupt|old_logit_model; see interrupt.py): every weight
update is sent with `abort_all_requests=true`, new sends wait until every worker has answered it, and each sample
it aborted is sent again from its prompt with its own sampling_seed (`stats["regenerated"]` counts them).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from mcore_rl.rollout.protocol import GenerationRequest, Sample, expand_requests
from mcore_rl.rollout.sglang.api import (
    generate_payload,
    parse_sample,
    single_generate_payload,
)
from mcore_rl.rollout.sglang.control import ControlCalls
from mcore_rl.rollout.sglang.interrupt import Interrupts
from mcore_rl.rollout.sglang.transport import HTTPTransport, SGLangClientConfig, SGLangHTTPError
from mcore_rl.rollout.sglang.weight_session import WeightSessions, WeightUpdateCalls

__all__ = ["AsyncSGLangClient", "SGLangClientConfig", "SGLangHTTPError"]
log = logging.getLogger(__name__)
Item = tuple[GenerationRequest, int, str]  # (request, sample index, SGLang rid)
ROUTING_KEY_HEADER = "x-smg-routing-key"  # sglang-router (sgl-model-gateway) header read by its manual policy


class AsyncSGLangClient(HTTPTransport, ControlCalls, WeightUpdateCalls):
    """Asyncio client; create and use it inside one event loop (transport: transport.py, abort/pause/memory:
    control.py, weight-update calls: weight_session.py)."""

    def __init__(
        self,
        config: SGLangClientConfig,
        on_payload: Callable[[str, dict], None] | None = None,
        version: int = 0,
        tolerate: Callable[[str], bool] | None = None,
    ) -> None:
        """tolerate(url): see HTTPTransport."""
        super().__init__(config, on_payload, tolerate)
        self.weight_version = int(version)
        self.stats.update(stale_dropped=0, regenerated=0)
        self.interrupts = Interrupts()
        self.sessions = WeightSessions(self)  # SGLang's begin/end_weight_update around tensor/nccl updates
        self._load = dict.fromkeys(config.worker_urls, 0)  # in-flight samples per worker
        self._inflight: dict[str, set[str]] = {}  # request rid -> sample rids in flight

    # ------------------------------------------------------------------ generation
    async def generate(
        self, requests: Sequence[GenerationRequest], on_sample: Callable[[int, Sample], None] | None = None
    ) -> list[Sample]:
        """Samples in protocol order; sample j of request `rid` travels as SGLang rid `rid#j` (abortable).

        on_sample(k, sample): called as soon as sample k (protocol order) is final, before the whole call returns
        (the engine resolves its per-sample futures with it: a schedule sees samples as they finish)."""
        floor = self.weight_version  # no token of this call may come from older weights
        items: list[Item] = []
        for req, j in expand_requests(requests):
            srid = f"{req.rid or uuid.uuid4().hex}#{j}"
            items.append((req, j, srid))
            if req.rid is not None:
                self._inflight.setdefault(req.rid, set()).add(srid)
        out: list[Sample | None] = [None] * len(items)
        todo = list(range(len(items)))
        index = {srid: k for k, (_, _, srid) in enumerate(items)}

        def final(srid: str, s: Sample) -> None:
            if on_sample is not None and not (s.weight_versions and min(s.weight_versions) < floor):
                on_sample(index[srid], s)

        try:
            for attempt in range(self.cfg.stale_retries + 1):
                samples = await self._generate_items([items[i] for i in todo], floor, final)
                stale = []
                for i, s in zip(todo, samples):
                    if s.weight_versions and min(s.weight_versions) < floor:
                        stale.append(i)
                    out[i] = s
                if not stale:
                    break
                self.stats["stale_dropped"] += len(stale)
                if attempt == self.cfg.stale_retries:
                    raise RuntimeError(
                        f"{len(stale)} samples still came back with weights older than v{floor} after "
                        f"{attempt} retries: a server is not getting weight updates"
                    )
                log.warning("dropped %d samples older than weight version %d; generating them again", len(stale), floor)
                await asyncio.sleep(min(self.cfg.backoff_s * 2**attempt, self.cfg.backoff_max_s))
                todo = stale
        finally:
            for req, _, srid in items:
                self.interrupts.caller_aborted.discard(srid)
                if req.rid is not None and req.rid in self._inflight:
                    self._inflight[req.rid].discard(srid)
                    if not self._inflight[req.rid]:
                        del self._inflight[req.rid]
        return out  # type: ignore[return-value]

    async def _generate_items(
        self, items: list[Item], floor: int, final: Callable[[str, Sample], None] | None = None
    ) -> list[Sample]:
        if self.cfg.router_url:  # one sample per request
            done = await asyncio.gather(*(self._restarting([it], self._send_one, final) for it in items))
            return list(itertools.chain.from_iterable(done))
        chunks = [items[i : i + self.cfg.batch_size] for i in range(0, len(items), self.cfg.batch_size)]
        done = await asyncio.gather(
            *(self._restarting(c, lambda part: self._generate_chunk(part, floor), final) for c in chunks)
        )
        return list(itertools.chain.from_iterable(done))

    async def _send_one(self, items: list[Item]) -> list[Sample]:
        return [await self._generate_one(items[0])]

    async def _restarting(
        self, items: list[Item], send: Callable[[list[Item]], Any], final: Callable[[str, Sample], None] | None
    ) -> list[Sample]:
        """send(items), then (interrupt mode) send again every sample an interrupting weight update aborted, until
        none is: each comes back whole, from the prompt, under the weights it was last sent to."""
        out: list[Sample | None] = [None] * len(items)
        todo = list(range(len(items)))
        while todo:
            await self.interrupts.gate().wait()  # no send while an interrupting update is under way
            sent = self.interrupts.mark()
            samples = await send([items[i] for i in todo])
            again = []
            for i, s in zip(todo, samples):
                out[i] = s
                if self.interrupts.restart(items[i][2], s, sent):
                    again.append(i)
                elif final is not None:
                    final(items[i][2], s)
            if again:
                self.stats["regenerated"] += len(again)
                log.info("%d sample(s) aborted by a weight update; generating them again from their prompts",
                         len(again))  # fmt: skip
            todo = again
        return out  # type: ignore[return-value]

    async def _generate_one(self, item: Item) -> Sample:
        """One sample through the router. A request whose metadata names a `routing_key` (an episode's turns carry
        the episode's) sends it as `x-smg-routing-key`: sglang-router's `manual` policy sends every request with
        the same key to the same worker, so an episode's growing prefix stays in one worker's cache."""
        payload = single_generate_payload(item, self.cfg.seeded)
        key = item[0].metadata.get("routing_key")
        out = await self.request("POST", self.cfg.router_url, "/generate", payload, self.cfg.timeout_s,
                                 headers={ROUTING_KEY_HEADER: str(key)} if key else None)  # fmt: skip
        if not isinstance(out, dict):
            raise ValueError(f"/generate at {self.cfg.router_url}: expected one result, got {str(out)[:200]}")
        return parse_sample(out, item[0], item[1], self.weight_version)

    def _pick_worker(self) -> str:
        now = time.monotonic()
        up = [u for u in self.cfg.worker_urls if self._down_until[u] <= now] or self.cfg.worker_urls
        return min(up, key=self._load.get)

    async def _generate_chunk(self, items: list[Item], floor: int) -> list[Sample]:
        picked: list[str] = []

        def pick() -> str:  # least loaded live worker, again on every retry
            if picked:
                self._load[picked[-1]] -= len(items)
            picked.append(self._pick_worker())
            self._load[picked[-1]] += len(items)
            return picked[-1]

        try:
            out = await self.request(
                "POST", pick, "/generate", generate_payload(items, self.cfg.seeded), self.cfg.timeout_s
            )
        finally:
            if picked:
                self._load[picked[-1]] -= len(items)
        if not isinstance(out, list) or len(out) != len(items):
            raise ValueError(
                f"/generate at {picked[-1]}: expected a list of {len(items)} results, got {str(out)[:200]}"
            )
        samples = [parse_sample(o, req, j, self.weight_version) for o, (req, j, _) in zip(out, items)]
        if any(s.weight_versions and min(s.weight_versions) < floor for s in samples):
            self._down_until[picked[-1]] = time.monotonic() + 5.0  # stale weights there: try the others first
        return samples

