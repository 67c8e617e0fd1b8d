"""HTTP transport of the SGLang client: one pooled aiohttp session with the API key's bearer header, a concurrency
limit, timeouts, and retries with exponential backoff on connection errors and 5xx (never on 4xx: a request SGLang
refused is refused again). Every payload is checked against the SGLang field table in `api.py` before it leaves;
control calls go to EVERY worker (`post_all`), never the router, which does not forward them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from mcore_rl.api_key import bearer_header
from mcore_rl.config.rollout import SGLangRolloutConfig as _Settings
from mcore_rl.rollout.sglang.api import check_payload

log = logging.getLogger(__name__)


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
    api_key: str | None = None  # `Authorization: Bearer` on every call (mcore_rl.api_key); repr hides it

    def __post_init__(self) -> None:
        self.worker_urls = [u.rstrip("/") for u in self.worker_urls]
        if not self.worker_urls:
            raise ValueError("SGLangClientConfig.worker_urls is empty: give the servers' base URLs")
        self.router_url = self.router_url.rstrip("/") if self.router_url else None

    def __repr__(self) -> str:
        return f"SGLangClientConfig(workers={self.worker_urls}, router={self.router_url}, api_key=***)"


class HTTPTransport:
    """Calls to the servers; the client's generation and control calls are built on `request` and `post_all`.
    Create and use it inside one event loop."""

    def __init__(
        self,
        config: SGLangClientConfig,
        on_payload: Callable[[str, dict], None] | None = None,
        tolerate: Callable[[str], bool] | None = None,
    ) -> None:
        """tolerate(url): True when a failed control call to that worker may be skipped (it is being
        restarted and gets the current weights replayed when it is back)."""
        self.cfg = config
        self.on_payload = on_payload  # observer of every payload sent (tests record them)
        self.tolerate = tolerate
        self.stats = {"http_retries": 0}
        self._session: aiohttp.ClientSession | None = None
        self._sem: asyncio.Semaphore | None = None
        self._down_until = dict.fromkeys(config.worker_urls, 0.0)  # avoid a worker that just failed

    async def _ensure(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = bearer_header(self.cfg.api_key)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.cfg.max_concurrency), headers=headers
            )
            self._sem = asyncio.Semaphore(self.cfg.max_concurrency)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        base: str | Callable[[], str],
        endpoint: str,
        payload: dict | None = None,
        timeout: float | None = None,
        retries: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """One HTTP call with retries (connection errors, 5xx) and backoff; 4xx raises at once.

        base: a URL, or a function picking one per attempt (so a retry can go to another worker).
        headers: extra headers of this call (e.g. sglang-router's `x-smg-routing-key`).
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
                async with (
                    self._sem,
                    session.request(method, url, json=payload, timeout=tmo, headers=headers) as resp,
                ):
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
