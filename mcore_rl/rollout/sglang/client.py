"""Asyncio HTTP client for SGLang servers (or sglang-router in front of them).

A pooled aiohttp session, a concurrency limit, timeouts, retries with exponential backoff on connection errors and
5xx (never on 4xx). /generate goes one request per sample through a router (its request type takes ONE prompt;
a list answers 422) and batched straight to workers (faster). Control calls (abort, pause, weight updates, memory)
go to EVERY worker, never the router, which does not forward them. Every payload is checked against the SGLang
field table in `api.py` before it leaves.

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
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from mcore_rl.config.rollout import SGLangRolloutConfig as _Settings
from mcore_rl.rollout.protocol import GenerationRequest, PauseMode, Sample, expand_requests
from mcore_rl.rollout.sglang.api import (
    check_payload,
    generate_payload,
    parse_sample,
    single_generate_payload,
)
from mcore_rl.rollout.sglang.interrupt import Interrupts
from mcore_rl.rollout.sglang.weight_session import WeightSessions, WeightUpdateCalls

log = logging.getLogger(__name__)
Item = tuple[GenerationRequest, int, str]  # (request, sample index, SGLang rid)


class SGLangHTTPError(RuntimeError):
    def __init__(self, status: int, url: str, body: str) -> None:
        super().__init__(f"HTTP {status} from {url}: {body[:500]}")
        self.status, self.url, self.body = status, url, body


@dataclass
class SGLangClientConfig:
    worker_urls: list[str]
    router_url: str | None = None  # /generate goes here when set; control calls always go to every worker
    # the tunables' defaults are rollout.*'s (SGLangRolloutConfig): one definition for the trainer and tools
    max_concurrency: int = _Settings.max_concurrency  # concurrent HTTP requests
    batch_size: int = _Settings.batch_size  # samples per /generate call to a worker (a router gets one per call)
    timeout_s: float = _Settings.timeout_s  # a /generate call
    control_timeout_s: float = _Settings.control_timeout_s  # weight updates, pause, health
    retries: int = _Settings.retries
    backoff_s: float = _Settings.backoff_s
    backoff_max_s: float = 10.0
    stale_retries: int = _Settings.stale_retries  # a sample coming back on stale weights is generated again
    seeded: bool = True  # send sampling_seed (SGLang needs --enable-deterministic-inference to honour it)
    api_key: str | None = None  # `Authorization: Bearer` on every call; never logged (repr hides it)

    def __post_init__(self) -> None:
        self.worker_urls = [u.rstrip("/") for u in self.worker_urls]
        if not self.worker_urls:
            raise ValueError("SGLangClientConfig.worker_urls is empty: give the servers' base URLs")
        self.router_url = self.router_url.rstrip("/") if self.router_url else None

    def __repr__(self) -> str:
        return f"SGLangClientConfig(workers={self.worker_urls}, router={self.router_url}, api_key=***)"


class AsyncSGLangClient(WeightUpdateCalls):
    """Asyncio client; create and use it inside one event loop (weight-update calls: weight_session.py)."""

    def __init__(
        self,
        config: SGLangClientConfig,
        on_payload: Callable[[str, dict], None] | None = None,
        version: int = 0,
        tolerate: Callable[[str], bool] | None = None,
    ) -> None:
        """tolerate(url): True when a failed control call to that worker may be skipped (it is being
        restarted and gets the current weights replayed when it is back)."""
        self.cfg = config
        self.on_payload = on_payload  # observer of every payload sent (tests record them)
        self.tolerate = tolerate
        self.weight_version = int(version)
        self.stats = {"http_retries": 0, "stale_dropped": 0, "regenerated": 0}
        self.interrupts = Interrupts()
        self.sessions = WeightSessions(self)  # SGLang's begin/end_weight_update around tensor/nccl updates
        self._session: aiohttp.ClientSession | None = None
        self._sem: asyncio.Semaphore | None = None
        self._load = dict.fromkeys(config.worker_urls, 0)  # in-flight samples per worker
        self._down_until = dict.fromkeys(config.worker_urls, 0.0)  # avoid a worker that just failed
        self._inflight: dict[str, set[str]] = {}  # request rid -> sample rids in flight

    async def _ensure(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else None
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.cfg.max_concurrency), headers=headers
            )
            self._sem = asyncio.Semaphore(self.cfg.max_concurrency)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------ transport
    async def request(
        self,
        method: str,
        base: str | Callable[[], str],
        endpoint: str,
        payload: dict | None = None,
        timeout: float | None = None,
        retries: int | None = None,
    ) -> Any:
        """One HTTP call with retries (connection errors, 5xx) and backoff; 4xx raises at once.

        base: a URL, or a function picking one per attempt (so a retry can go to another worker).
        """
        if payload is not None:
            check_payload(endpoint, payload)
            if self.on_payload is not None:
                self.on_payload(endpoint, payload)
        session = await self._ensure()
        tmo = aiohttp.ClientTimeout(total=timeout or self.cfg.control_timeout_s)
        retries = self.cfg.retries if retries is None else retries
        for attempt in range(retries + 1):
            url = (base() if callable(base) else base) + endpoint
            try:
                async with self._sem, session.request(method, url, json=payload, timeout=tmo) as resp:
                    body = await resp.text()
                    if resp.status < 400:
                        return json.loads(body) if body.strip().startswith(("{", "[")) else body
                    err: Exception = SGLangHTTPError(resp.status, url, body)
                    if resp.status < 500:
                        raise err
            except aiohttp.ClientConnectionError as exc:
                err = exc
            base_url = url[: -len(endpoint)]
            if base_url in self._down_until:
                self._down_until[base_url] = time.monotonic() + 5.0
            if attempt == retries:
                raise err
            self.stats["http_retries"] += 1
            delay = min(self.cfg.backoff_s * 2**attempt, self.cfg.backoff_max_s)
            log.warning("%s %s failed (%s); retry %d in %.1fs", method, url, err, attempt + 1, delay)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    def live_workers(self) -> list[str]:
        """Worker URLs, less those known dead or coming back (they get the current weights when they are up)."""
        if self.tolerate is None:
            return list(self.cfg.worker_urls)
        return [u for u in self.cfg.worker_urls if not self.tolerate(u)]

    async def post_all(self, endpoint: str, payload: dict, timeout: float | None = None) -> dict[str, Any]:
        """POST the same body to every worker concurrently; raise the first failure that is not tolerated.
        Returns {url: reply} of the workers that answered."""
        urls = self.live_workers()
        results = await asyncio.gather(
            *(self.request("POST", u, endpoint, payload, timeout) for u in urls), return_exceptions=True
        )
        for url, res in zip(urls, results):
            if isinstance(res, BaseException):
                if self.tolerate is not None and self.tolerate(url):
                    log.warning("%s%s skipped: worker is restarting (%s)", url, endpoint, res)
                    continue
                raise res
        return {u: r for u, r in zip(urls, results) if not isinstance(r, BaseException)}

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
        payload = single_generate_payload(item, self.cfg.seeded)
        out = await self.request("POST", self.cfg.router_url, "/generate", payload, self.cfg.timeout_s)
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

    async def abort(self, rid: str | None = None) -> None:
        if rid is None:
            self.interrupts.caller_aborts += 1
            await self.post_all("/abort_request", {"rid": "", "abort_all": True})
            return
        subs = sorted(self._inflight.get(rid, ()))
        self.interrupts.caller_aborted.update(subs)
        await asyncio.gather(*(self.post_all("/abort_request", {"rid": s}) for s in subs))

    async def check_abort(self) -> None:
        """Interrupt mode needs workers that abort: each must answer /abort_request (an unknown rid is a no-op in
        SGLang). One line naming the URL otherwise (a router or another server given as a worker URL)."""
        for url in self.cfg.worker_urls:
            try:
                await self.request("POST", url, "/abort_request", {"rid": "mcore-rl-abort-probe"}, retries=0)
            except (SGLangHTTPError, aiohttp.ClientError, TimeoutError) as exc:
                raise RuntimeError(
                    f"rollout.worker_urls: {url} cannot abort requests ({str(exc).splitlines()[0][:200]}); interrupt "
                    "mode (old_logp_source=interrupt|old_logit_model) needs SGLang workers that answer "
                    "/abort_request and honour abort_all_requests (a router does not forward aborts)"
                ) from None

    # ------------------------------------------------------------------ control
    async def pause(self, mode: PauseMode = "abort") -> None:
        if mode == "abort":
            self.interrupts.caller_aborts += 1
        await self.post_all("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self.post_all("/continue_generation", {})

    async def flush_cache(self) -> None:
        await self.post_all("/flush_cache", {})

    async def release_memory(self, tags: list[str] | None = None) -> None:
        await self.post_all("/release_memory_occupation", {"tags": tags} if tags else {})

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        await self.post_all("/resume_memory_occupation", {"tags": tags} if tags else {})

    async def health(self) -> bool:
        async def one(url: str) -> bool:
            try:
                await self.request("GET", url, "/health", None, timeout=20.0, retries=0)
                return True
            except (TimeoutError, SGLangHTTPError, aiohttp.ClientError):
                return False

        return all(await asyncio.gather(*(one(u) for u in self.cfg.worker_urls)))
