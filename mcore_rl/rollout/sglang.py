"""Rollout engine over one or more SGLang servers (or a router in front of them), via HTTP.

`AsyncSGLangClient` is the asyncio client: a pooled aiohttp session, a concurrency limit, timeouts, retries
with exponential backoff on connection errors and 5xx (never on 4xx), batched /generate with log-probs.
Control calls (abort, pause, weight updates, memory) go to EVERY worker, because sglang-router does not
forward them. `SGLangEngine` wraps it behind the synchronous RolloutEngine protocol with its own event-loop
thread, so plain trainer code can call it and another thread can abort while generate() blocks.
Every payload is checked against the SGLang field table in `sglang_api.py` before it leaves.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import torch

from mcore_rl.rollout import sglang_sync
from mcore_rl.rollout.protocol import GenerationRequest, PauseMode, Sample, expand_requests, register_engine
from mcore_rl.rollout.sglang_api import check_payload, generate_payload, init_group_payload, parse_sample

log = logging.getLogger(__name__)


class SGLangHTTPError(RuntimeError):
    def __init__(self, status: int, url: str, body: str) -> None:
        super().__init__(f"HTTP {status} from {url}: {body[:500]}")
        self.status, self.url, self.body = status, url, body


@dataclass
class SGLangClientConfig:
    worker_urls: list[str]
    router_url: str | None = None  # /generate goes here when set; control calls always go to every worker
    max_concurrency: int = 32  # concurrent HTTP requests
    batch_size: int = 16  # samples per /generate call
    timeout_s: float = 3600.0  # a /generate call
    control_timeout_s: float = 600.0  # weight updates, pause, health
    retries: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 10.0

    def __post_init__(self) -> None:
        self.worker_urls = [u.rstrip("/") for u in self.worker_urls]
        if not self.worker_urls:
            raise ValueError("SGLangClientConfig.worker_urls is empty: give the servers' base URLs")
        self.router_url = self.router_url.rstrip("/") if self.router_url else None


class AsyncSGLangClient:
    """Asyncio client; create and use it inside one event loop."""

    def __init__(
        self,
        config: SGLangClientConfig,
        on_payload: Callable[[str, dict], None] | None = None,
        version: int = 0,
    ) -> None:
        self.cfg = config
        self.on_payload = on_payload  # observer of every payload sent (tests record them)
        self.weight_version = int(version)
        self._session: aiohttp.ClientSession | None = None
        self._sem: asyncio.Semaphore | None = None
        self._load = dict.fromkeys(config.worker_urls, 0)  # in-flight samples per worker
        self._inflight: dict[str, set[str]] = {}  # request rid -> sample rids in flight

    async def _ensure(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.cfg.max_concurrency)
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
        base: str,
        endpoint: str,
        payload: dict | None = None,
        timeout: float | None = None,
        retries: int | None = None,
    ) -> Any:
        """One HTTP call with retries (connection errors, 5xx) and backoff; 4xx raises at once."""
        if payload is not None:
            check_payload(endpoint, payload)
            if self.on_payload is not None:
                self.on_payload(endpoint, payload)
        session = await self._ensure()
        url = base + endpoint
        tmo = aiohttp.ClientTimeout(total=timeout or self.cfg.control_timeout_s)
        retries = self.cfg.retries if retries is None else retries
        for attempt in range(retries + 1):
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
            if attempt == retries:
                raise err
            delay = min(self.cfg.backoff_s * 2**attempt, self.cfg.backoff_max_s)
            log.warning("%s %s failed (%s); retry %d in %.1fs", method, url, err, attempt + 1, delay)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def post_all(self, endpoint: str, payload: dict, timeout: float | None = None) -> list[Any]:
        """POST the same body to every worker concurrently; raise the first failure."""
        return list(
            await asyncio.gather(
                *(self.request("POST", u, endpoint, payload, timeout) for u in self.cfg.worker_urls)
            )
        )

    # ------------------------------------------------------------------ generation
    async def generate(self, requests: Sequence[GenerationRequest]) -> list[Sample]:
        """Samples in protocol order; sample j of request `rid` travels as SGLang rid `rid#j` (abortable)."""
        items = []
        for req, j in expand_requests(requests):
            srid = f"{req.rid or uuid.uuid4().hex}#{j}"
            items.append((req, j, srid))
            if req.rid is not None:
                self._inflight.setdefault(req.rid, set()).add(srid)
        chunks = [items[i : i + self.cfg.batch_size] for i in range(0, len(items), self.cfg.batch_size)]
        try:
            results = await asyncio.gather(*(self._generate_chunk(c) for c in chunks))
        finally:
            for req, _, srid in items:
                if req.rid is not None and req.rid in self._inflight:
                    self._inflight[req.rid].discard(srid)
                    if not self._inflight[req.rid]:
                        del self._inflight[req.rid]
        return list(itertools.chain.from_iterable(results))

    async def _generate_chunk(self, items: list[tuple[GenerationRequest, int, str]]) -> list[Sample]:
        if self.cfg.router_url:
            base = self.cfg.router_url
        else:
            base = min(self._load, key=self._load.get)
        self._load[base] = self._load.get(base, 0) + len(items)
        try:
            out = await self.request("POST", base, "/generate", generate_payload(items), self.cfg.timeout_s)
        finally:
            self._load[base] -= len(items)
        if not isinstance(out, list) or len(out) != len(items):
            raise ValueError(
                f"/generate at {base}: expected a list of {len(items)} results, got {str(out)[:200]}"
            )
        return [parse_sample(o, req, j, self.weight_version) for o, (req, j, _) in zip(out, items)]

    async def abort(self, rid: str | None = None) -> None:
        if rid is None:
            await self.post_all("/abort_request", {"rid": "", "abort_all": True})
            return
        subs = sorted(self._inflight.get(rid, ()))
        await asyncio.gather(*(self.post_all("/abort_request", {"rid": s}) for s in subs))

    # ------------------------------------------------------------------ control
    async def pause(self, mode: PauseMode = "abort") -> None:
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
                await self.request("GET", url, "/health", None, timeout=10.0, retries=0)
                return True
            except (TimeoutError, SGLangHTTPError, aiohttp.ClientError):
                return False

        return all(await asyncio.gather(*(one(u) for u in self.cfg.worker_urls)))

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        payload = {"model_path": str(path), "weight_version": str(version), "flush_cache": True}
        for url, res in zip(self.cfg.worker_urls, await self.post_all("/update_weights_from_disk", payload)):
            if isinstance(res, dict) and res.get("success") is False:
                raise RuntimeError(f"{url}/update_weights_from_disk failed: {res.get('message')}")
        self.weight_version = int(version)

    async def update_weight_version(self, version: int, abort_all_requests: bool = False) -> None:
        payload = {"new_version": str(version), "abort_all_requests": abort_all_requests}
        await self.post_all("/update_weight_version", payload)
        self.weight_version = int(version)

    async def update_weights_from_tensor(self, url: str, payload: dict) -> None:
        res = await self.request("POST", url, "/update_weights_from_tensor", payload)
        if isinstance(res, dict) and res.get("success") is False:
            raise RuntimeError(f"{url}/update_weights_from_tensor failed: {res.get('message')}")

    async def init_weights_update_group(
        self, master_address: str, master_port: int, tp_sizes: list[int], group_name: str, backend: str
    ) -> None:
        """Tell worker i to join as ranks [1 + sum(tp[:i]), ...) of a group whose rank 0 is the trainer."""
        world = 1 + sum(tp_sizes)
        offsets = list(itertools.accumulate([1, *tp_sizes[:-1]]))
        await asyncio.gather(
            *(
                self.request(
                    "POST", url, "/init_weights_update_group",
                    init_group_payload(master_address, master_port, off, world, group_name, backend),
                )
                for url, off in zip(self.cfg.worker_urls, offsets)
            )
        )  # fmt: skip

    async def update_weights_from_distributed(self, payload: dict) -> None:
        await self.post_all("/update_weights_from_distributed", payload)


@dataclass
class _LoopThread:
    """A private event loop on a daemon thread: sync callers submit coroutines to it."""

    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self.loop.run_forever, name="sglang-client-loop", daemon=True)
        self.thread.start()

    def submit(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro) -> Any:
        return self.submit(coro).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@register_engine("sglang")
class SGLangEngine:
    """RolloutEngine over SGLang servers. Weight sync: `disk` (any setup), `tensor` (colocated), `nccl`."""

    def __init__(
        self,
        worker_urls: list[str] | None = None,
        router_url: str | None = None,
        *,
        launcher: dict | None = None,
        model_path: str | None = None,
        seed: int | None = None,
        weight_sync: str = "disk",
        weight_dir: str | None = None,
        keep_versions: int = 2,
        bucket_mb: float = 512.0,
        tp_size: int = 1,
        nccl: dict | None = None,
        weight_version: int = 0,
        on_payload: Callable[[str, dict], None] | None = None,
        **client_kwargs: Any,
    ) -> None:
        """`worker_urls` of running servers, or (when empty) `launcher` settings to start them here.

        seed: requests without their own seed get reproducible per-request seeds from it.
        weight_sync: how update_weights() ships tensors -- disk (a versioned folder under `weight_dir` that
        every server can read), tensor (colocated CUDA IPC), nccl (broadcast; `nccl` = {master_address,
        master_port, backend} to create the group on first use).
        """
        if weight_sync not in sglang_sync.WEIGHT_SYNC:
            raise ValueError(f"weight_sync={weight_sync!r} not in {sorted(sglang_sync.WEIGHT_SYNC)}")
        self._launcher = None
        if not worker_urls and launcher is not None:
            from mcore_rl.rollout.launcher import LauncherConfig, ServerLauncher

            launch = {**launcher, "model_path": launcher.get("model_path") or model_path}
            self._launcher = ServerLauncher(LauncherConfig(**launch)).start()
            worker_urls, router_url = self._launcher.worker_urls, self._launcher.router_url
            tp_size = self._launcher.cfg.tp_size
        self.cfg = SGLangClientConfig(
            worker_urls=list(worker_urls or []), router_url=router_url, **client_kwargs
        )
        self.model_path, self.weight_sync, self.weight_dir = model_path, weight_sync, weight_dir
        self.keep_versions, self.bucket_bytes, self.tp_size = keep_versions, int(bucket_mb * 2**20), tp_size
        self.nccl = dict(nccl or {})
        self._seeds = random.Random(seed) if seed is not None else None
        self._lt = _LoopThread()
        self.client = AsyncSGLangClient(self.cfg, on_payload=on_payload, version=weight_version)
        self.groups: dict[str, Any] = {}  # group_name -> process group (NCCL weight sync)

    def _seeded(self, requests: Sequence[GenerationRequest]) -> list[GenerationRequest]:
        if self._seeds is None:
            return list(requests)
        return [
            r
            if r.sampling.seed is not None
            else replace(r, sampling=replace(r.sampling, seed=self._seeds.getrandbits(62)))
            for r in requests
        ]

    # ------------------------------------------------------------------ protocol
    @property
    def weight_version(self) -> int:
        return self.client.weight_version

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Sample]:
        return self._lt.run(self.client.generate(self._seeded(requests)))

    def submit(self, requests: Sequence[GenerationRequest]) -> list[Future]:
        """Start generating now; one Future[Sample] per sample (request-major), like LocalEngine.submit."""
        requests = self._seeded(requests)
        futures: list[Future] = [Future() for _ in expand_requests(requests)]

        def fan_out(batch: Future) -> None:
            if batch.exception() is not None:
                for f in futures:
                    f.set_exception(batch.exception())
            else:
                for f, sample in zip(futures, batch.result()):
                    f.set_result(sample)

        self._lt.submit(self.client.generate(requests)).add_done_callback(fan_out)
        return futures

    def abort(self, rid: str | None = None) -> None:
        self._lt.run(self.client.abort(rid))

    def pause(self, mode: PauseMode = "abort") -> None:
        self._lt.run(self.client.pause(mode))

    def resume(self) -> None:
        self._lt.run(self.client.resume())

    def release_memory(self) -> None:
        self._lt.run(self.client.release_memory())

    def resume_memory(self) -> None:
        self._lt.run(self.client.resume_memory())

    def health(self) -> bool:
        return self._lt.run(self.client.health())

    def flush_cache(self) -> None:
        self._lt.run(self.client.flush_cache())

    def update_weights_from_disk(self, path: str, version: int) -> None:
        self._lt.run(self.client.update_weights_from_disk(path, version))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        sglang_sync.WEIGHT_SYNC[self.weight_sync](self, named_tensors, version)

    def update_weight_version(self, version: int, abort_all_requests: bool = False) -> None:
        self._lt.run(self.client.update_weight_version(version, abort_all_requests))

    def close(self) -> None:
        try:
            self._lt.run(self.client.close())
        finally:
            self._lt.stop()
            if self._launcher is not None:
                self._launcher.stop()

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ weight sync
    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ):
        """Join every server and this process (rank 0) in a side group for broadcasts; returns the group.

        For pipeline parallelism, each PP stage's source rank makes its own engine client and group (own port
        and group_name) and calls update_weights_from_distributed with that stage's tensors.
        """
        return sglang_sync.init_group(self, master_address, master_port, group_name, backend)

    def update_weights_from_distributed(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, group_name: str | None = None
    ) -> None:
        """Announce each bucket over HTTP while broadcasting its tensors from rank 0 of the group."""
        sglang_sync.broadcast_update(self, named_tensors, version, group_name)
