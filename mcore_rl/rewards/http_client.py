"""The HTTP client every service-backed reward shares (`remote`, `rm` with placement=server, `judge`).

Why one module: the three talk to different services but need the same failure handling, and a fix to it (a retry
rule, a timeout, the key header) must reach all of them. A request is retried with exponential backoff on timeouts,
connection errors, 5xx, 408 and 429 (the next attempt goes to the next URL when there are several); a malformed
body or another 4xx is not retried. Requests run concurrently (at most `max_concurrency` in flight) on an event loop
of their own, in a thread, so a reward's synchronous `score` can be called from anywhere. The API key is read from a
mode-600 file (mcore_rl/api_key.py) and sent as `Authorization: Bearer`; it is never logged or described, and URLs
are shown without credentials or query strings.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from mcore_rl.api_key import ApiKeyError, bearer_header, read_api_key

logger = logging.getLogger(__name__)
MAX_BACKOFF_S = 30.0  # the wait between attempts doubles from backoff_s up to this
RETRIED_STATUS = (408, 429)  # besides every 5xx


@dataclass(frozen=True)
class RetryPolicy:
    """How a client sends: requests in flight, the per-attempt timeout, attempts per request, the first backoff."""

    max_concurrency: int = 4
    timeout_s: float = 60.0
    max_attempts: int = 5
    backoff_s: float = 1.0


def check_policy(cfg: Any, where: str) -> None:
    """The four RetryPolicy fields of a reward's config: positive (backoff_s >= 0); one line naming the field."""
    for key in ("max_concurrency", "timeout_s", "max_attempts"):
        if getattr(cfg, key) <= 0:
            raise ValueError(f"{where}.{key}={getattr(cfg, key)!r} must be > 0")
    if cfg.backoff_s < 0:
        raise ValueError(f"{where}.backoff_s={cfg.backoff_s} must be >= 0")


def policy_of(cfg: Any) -> RetryPolicy:
    return RetryPolicy(cfg.max_concurrency, cfg.timeout_s, cfg.max_attempts, cfg.backoff_s)


def shown_url(url: str) -> str:
    """scheme://host[:port]/path: no user:password, query or fragment (they may hold secrets)."""
    p = urlsplit(url)
    host = p.hostname or ""
    return f"{p.scheme}://{host}{f':{p.port}' if p.port else ''}{p.path}"


def check_urls(urls: Sequence[str], where: str) -> list[str]:
    """Each an http(s) URL with a host (one line naming `where` otherwise)."""
    for u in urls:
        parts = urlsplit(str(u))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{where}: {shown_url(str(u))!r} is not an http(s) URL with a host")
    return [str(u) for u in urls]


def check_key_file(path: str | None, where: str) -> None:
    """The key file is readable and mode 600 (before any model is built)."""
    if path:
        try:
            read_api_key(path)
        except ApiKeyError as e:
            raise ValueError(f"{where}.api_key_file: {e}") from None


@dataclass
class Outcome:
    """One request after its attempts: `value` is what `accept` made of the body (None: the request failed, `kind`
    says why: timeout, connection, http_<status>, malformed)."""

    value: Any
    kind: str | None = None
    retries: int = 0


class HttpClient:
    """POSTs JSON bodies to `urls` (request k starts at URL k, each retry moves to the next) with a RetryPolicy."""

    def __init__(
        self, urls: Sequence[str], policy: RetryPolicy, api_key_file: str | None = None, name: str = "reward"
    ) -> None:
        self.urls, self.policy, self.name = list(urls), policy, name
        key = read_api_key(api_key_file) if api_key_file else None
        self._headers = {"Content-Type": "application/json", **(bearer_header(key) or {})}
        self._session: Any = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"mcore-rl-{name}-http", daemon=True
        )
        self._thread.start()

    def post_all(
        self, payloads: list[dict], accept: Callable[[int, Any], Any], path: str = ""
    ) -> list[Outcome]:
        """Send every payload to `<url><path>`; `accept(k, parsed JSON of payload k's answer) -> value`, None
        meaning malformed (not retried: the service answered, and would answer the same again)."""
        coro = self._post_all(payloads, accept, path)
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _post_all(
        self, payloads: list[dict], accept: Callable[[int, Any], Any], path: str
    ) -> list[Outcome]:
        if self._session is None:
            import aiohttp

            self._session = aiohttp.ClientSession()
        gate = asyncio.Semaphore(self.policy.max_concurrency)
        return list(
            await asyncio.gather(*(self._post(k, p, accept, path, gate) for k, p in enumerate(payloads)))
        )

    async def _post(
        self, k: int, payload: dict, accept: Callable[[int, Any], Any], path: str, gate: asyncio.Semaphore
    ) -> Outcome:
        p, kind = self.policy, None
        for attempt in range(p.max_attempts):
            if attempt:
                await asyncio.sleep(min(p.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
            url = self.urls[(k + attempt) % len(self.urls)] + path
            async with gate:
                kind, body, retry = await self._attempt(url, payload)
            if kind is None:
                value = accept(k, body)
                return Outcome(value, None if value is not None else "malformed", attempt)
            logger.debug("%s: %s attempt %d failed: %s", self.name, shown_url(url), attempt + 1, kind)
            if not retry:
                return Outcome(None, kind, attempt)
        return Outcome(None, kind, p.max_attempts - 1)

    async def _attempt(self, url: str, payload: dict) -> tuple[str | None, Any, bool]:
        """(failure kind or None, parsed JSON body, whether to retry)."""
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.policy.timeout_s)
        try:
            async with self._session.post(url, json=payload, headers=self._headers, timeout=timeout) as resp:
                if resp.status >= 400:
                    return f"http_{resp.status}", None, resp.status >= 500 or resp.status in RETRIED_STATUS
                raw = await resp.read()
        except TimeoutError:
            return "timeout", None, True
        except aiohttp.ClientError:
            return "connection", None, True
        try:
            return None, json.loads(raw), False
        except ValueError:
            return "malformed", None, False

    def close(self) -> None:
        """Close the HTTP session and stop the loop's thread (idempotent)."""
        if self._loop.is_closed():
            return
        if self._session is not None:
            asyncio.run_coroutine_threadsafe(self._session.close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


def count_outcomes(counts: Counter, prefix: str, outcomes: list[Outcome]) -> None:
    """Adds `<prefix>_requests`, `_requests_failed` and `_retries` to `counts` (read by a reward's `metrics()`)."""
    counts.update(
        {
            f"{prefix}_requests": len(outcomes),
            f"{prefix}_retries": sum(o.retries for o in outcomes),
            f"{prefix}_requests_failed": sum(o.value is None for o in outcomes),
        }
    )


def failure_summary(outcomes: list[Outcome], sizes: list[int]) -> str | None:
    """The failures of one call in words, for a warning line (None when every request succeeded), e.g.
    `2 of 6 requests failed (malformed=1, timeout=1) after 3 retries in all; their 2 samples`."""
    failed = [(n, o.kind) for n, o in zip(sizes, outcomes) if o.value is None]
    if not failed:
        return None
    kinds = Counter(kind for _, kind in failed)
    return (
        f"{len(failed)} of {len(outcomes)} requests failed ({', '.join(f'{k}={v}' for k, v in sorted(kinds.items()))}"
        f") after {sum(o.retries for o in outcomes)} retries in all; their {sum(n for n, _ in failed)} samples"
    )
