"""`remote` reward: an HTTP reward service speaking OpenRLHF's remote reward model protocol.

`reward=remote reward.remote.url=http://host:5000/get_reward` POSTs `{"query": [...], "prompts": [...], "labels":
[...]}` (three lists of equal length: the templated prompt followed by the response, decoded with special tokens
kept; the templated prompt; the gold answer) and reads `{"rewards": [...], "scores"?: [...], "extra_logs"?: {key:
[...]}}`. That is what OpenRLHF sends and reads (`openrlhf/utils/remote_rm_utils.py` v0.9.0, `utils/agent.py`
v0.11.0, reference server `openrlhf/cli/serve_rm.py`), so a service written for OpenRLHF works unchanged.

Unlike OpenRLHF (5 attempts with 1 s sleeps, then an exception or a silently missing reward), a request here is
retried with exponential backoff on timeouts, connection errors, 5xx, 408 and 429 (the next attempt goes to the
next URL when there are several); after its last attempt, or at once on a malformed body or another 4xx, each of
its samples scores 0 with reason `remote_error:<kind>` (timeout, connection, http_<status>, malformed), counted in
`reward_remote_failures` and named in one warning line per step. Requests run concurrently (at most
`max_concurrency` in flight) on an event loop of their own, in a thread, so `score` can be called from anywhere.
The API key is read from a mode-600 file (mcore_rl/api_key.py) and sent as `Authorization: Bearer`; it is never
logged or described.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from mcore_rl.api_key import ApiKeyError, bearer_header, read_api_key
from mcore_rl.rewards.base import RewardResult, check_lengths, finite_number
from mcore_rl.rewards.registry import register_reward
from mcore_rl.utils import config_from_dict

logger = logging.getLogger(__name__)
OK = "ok"
MAX_BACKOFF_S = 30.0  # the wait between attempts doubles from backoff_s up to this
RETRIED_STATUS = (408, 429)  # besides every 5xx


@dataclass
class RemoteRewardConfig:
    url: str | None = None  # the service's endpoint (OpenRLHF's --remote_rm_url), e.g. http://host:5000/get_reward
    urls: list[str] = field(default_factory=list)  # several endpoints: batches go round-robin, retries to the next
    batch_size: int = 32  # samples per request
    max_concurrency: int = 4  # requests in flight at once
    timeout_s: float = 60.0  # per attempt (connect + answer)
    max_attempts: int = 5  # attempts per request, the first included
    backoff_s: float = 1.0  # wait before the second attempt; doubles each time (at most 30 s)
    api_key_file: str | None = None  # mode-600 file holding the key, sent as "Authorization: Bearer <key>"

    def __post_init__(self) -> None:
        for key in ("batch_size", "max_concurrency", "timeout_s", "max_attempts"):
            if getattr(self, key) <= 0:
                raise ValueError(f"reward.remote.{key}={getattr(self, key)!r} must be > 0")
        if self.backoff_s < 0:
            raise ValueError(f"reward.remote.backoff_s={self.backoff_s} must be >= 0")


def endpoints(cfg: RemoteRewardConfig, where: str = "reward.remote") -> list[str]:
    """`url` then `urls`, each checked to be an http(s) URL with a host."""
    found = ([cfg.url] if cfg.url else []) + [u for u in cfg.urls if u != cfg.url]
    if not found:
        raise ValueError(f"{where}.url is not set: give the service's endpoint, e.g. "
                         f"{where}.url=http://host:5000/get_reward (or {where}.urls=[...])")
    for u in found:
        parts = urlsplit(str(u))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{where}: {shown_url(str(u))!r} is not an http(s) URL with a host")
    return [str(u) for u in found]


def check_remote(cfg: RemoteRewardConfig, where: str = "reward.remote") -> None:
    """Before any model is built: the endpoints parse and the key file is readable, mode 600."""
    endpoints(cfg, where)
    if cfg.api_key_file:
        try:
            read_api_key(cfg.api_key_file)
        except ApiKeyError as e:
            raise ValueError(f"{where}.api_key_file: {e}") from None


def shown_url(url: str) -> str:
    """scheme://host[:port]/path: no user:password, query or fragment (they may hold secrets)."""
    p = urlsplit(url)
    host = p.hostname or ""
    return f"{p.scheme}://{host}{f':{p.port}' if p.port else ''}{p.path}"


def prompt_text(record: dict) -> str:
    """The templated prompt the trainer adds (`prompt_text`); without it (a caller with no tokenizer) the raw
    prompt: the text itself, or the messages' contents one per line."""
    if record.get("prompt_text") is not None:
        return str(record["prompt_text"])
    prompt = record.get("prompt")
    if isinstance(prompt, list):
        return "\n".join(str(m.get("content", "")) for m in prompt if isinstance(m, dict))
    return "" if prompt is None else str(prompt)


def parse_rewards(body: Any, n: int) -> list[tuple[float, bool, str, dict[str, float]]] | None:
    """OpenRLHF's response -> per-sample (score, correct, reason, extra metrics); None when malformed. `rewards`
    is the score; `correct` is `scores` (falling back to `rewards`, as OpenRLHF does) >= 1; `extra_logs` lists of
    numbers become metrics (others are not logged)."""
    if not isinstance(body, dict) or not isinstance(body.get("rewards"), list) or len(body["rewards"]) != n:
        return None
    rewards = body["rewards"]
    scores = body.get("scores")
    scores = scores if isinstance(scores, list) and len(scores) == n else rewards
    logs = body.get("extra_logs") if isinstance(body.get("extra_logs"), dict) else {}
    logs = {k: v for k, v in logs.items() if isinstance(k, str) and isinstance(v, list) and len(v) == n}
    out = []
    for i in range(n):
        r = finite_number(rewards[i])
        if isinstance(r, str):
            out.append((0.0, False, r, {}))
            continue
        s = finite_number(scores[i])
        metrics = {k: float(v[i]) for k, v in logs.items() if isinstance(finite_number(v[i]), float)}
        out.append((r, isinstance(s, float) and s >= 1.0, OK, metrics))
    return out


@dataclass
class _Outcome:
    items: list | None  # parsed per-sample results; None: the request failed
    kind: str | None = None  # why it failed
    retries: int = 0


class RemoteReward:
    """Scores through the service; see the module docstring for the protocol and the failure handling."""

    uses_text = True  # records carry the templated prompt and the query (trainer/rounds.py)

    def __init__(self, cfg: RemoteRewardConfig, where: str = "reward.remote") -> None:
        self.cfg, self.urls = cfg, endpoints(cfg, where)
        key = read_api_key(cfg.api_key_file) if cfg.api_key_file else None
        self._headers = {"Content-Type": "application/json", **(bearer_header(key) or {})}
        self._counts: Counter = Counter()
        self._session: Any = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcore-rl-remote-reward", daemon=True)
        self._thread.start()

    def score(self, responses: list[str], answers: list[str], records: list[dict] | None = None
              ) -> list[RewardResult]:
        check_lengths(responses, answers, records)
        records = records if records is not None else [{"answer": a} for a in answers]
        prompts = [prompt_text(r) for r in records]
        queries = [r.get("query") or p + (resp or "") for r, p, resp in zip(records, prompts, responses)]
        labels = ["" if a is None else a for a in answers]
        n = self.cfg.batch_size
        spans = [(i, min(i + n, len(responses))) for i in range(0, len(responses), n)]
        payloads = [{"query": queries[a:b], "prompts": prompts[a:b], "labels": labels[a:b]} for a, b in spans]
        outcomes = asyncio.run_coroutine_threadsafe(self._post_all(payloads), self._loop).result()
        results: list[RewardResult] = []
        for (a, b), o in zip(spans, outcomes):
            if o.items is None:
                results += [RewardResult(0.0, False, f"remote_error:{o.kind}", None) for _ in range(b - a)]
            else:
                results += [RewardResult(s, c, r, None, 0.0, m) for s, c, r, m in o.items]
        self._log(spans, outcomes)
        return results

    async def _post_all(self, payloads: list[dict]) -> list[_Outcome]:
        if self._session is None:
            import aiohttp

            self._session = aiohttp.ClientSession()
        gate = asyncio.Semaphore(self.cfg.max_concurrency)
        return list(await asyncio.gather(*(self._post(k, p, gate) for k, p in enumerate(payloads))))

    async def _post(self, k: int, payload: dict, gate: asyncio.Semaphore) -> _Outcome:
        """One request with its retries; request k starts at URL k (round-robin), each retry moves to the next."""
        kind = None
        for attempt in range(self.cfg.max_attempts):
            if attempt:
                await asyncio.sleep(min(self.cfg.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
            url = self.urls[(k + attempt) % len(self.urls)]
            async with gate:
                kind, body, retry = await self._attempt(url, payload)
            if kind is None:
                items = parse_rewards(body, len(payload["query"]))
                return _Outcome(items, None if items is not None else "malformed", attempt)
            logger.debug("remote reward: %s attempt %d failed: %s", shown_url(url), attempt + 1, kind)
            if not retry:
                return _Outcome(None, kind, attempt)
        return _Outcome(None, kind, self.cfg.max_attempts - 1)

    async def _attempt(self, url: str, payload: dict) -> tuple[str | None, Any, bool]:
        """(failure kind or None, parsed JSON body, whether to retry)."""
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.cfg.timeout_s)
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

    def _log(self, spans: list[tuple[int, int]], outcomes: list[_Outcome]) -> None:
        failed = [(b - a, o.kind) for (a, b), o in zip(spans, outcomes) if o.items is None]
        retries = sum(o.retries for o in outcomes)
        self._counts.update(reward_remote_retries=retries, reward_remote_requests=len(outcomes),
                            reward_remote_requests_failed=len(failed))
        if failed:
            kinds = Counter(kind for _, kind in failed)
            logger.warning("remote reward: %d of %d requests failed (%s) after %d retries in all; their %d samples "
                           "scored 0 (reason remote_error:<kind>)", len(failed), len(outcomes),
                           ", ".join(f"{k}={v}" for k, v in sorted(kinds.items())), retries,
                           sum(n for n, _ in failed))

    def metrics(self) -> dict[str, float]:
        """Request counts since the last call (the trainer reads them once per scored round)."""
        out = {k: float(self._counts[k]) for k in
               ("reward_remote_requests", "reward_remote_requests_failed", "reward_remote_retries")}
        self._counts.clear()
        return out

    def describe(self) -> str:
        c = self.cfg
        return (f"remote {', '.join(shown_url(u) for u in self.urls)} (OpenRLHF protocol; batch_size={c.batch_size}, "
                f"max_concurrency={c.max_concurrency}, timeout_s={c.timeout_s:g} per attempt, "
                f"max_attempts={c.max_attempts}, backoff_s={c.backoff_s:g}, "
                f"api key: {'from api_key_file' if c.api_key_file else 'none'})")

    def close(self) -> None:
        """Close the HTTP session and stop the loop's thread (idempotent)."""
        if self._loop.is_closed():
            return
        if self._session is not None:
            asyncio.run_coroutine_threadsafe(self._session.close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


@register_reward("remote", RemoteRewardConfig, check=check_remote)
def build_remote(options: dict[str, Any]) -> RemoteReward:
    return RemoteReward(config_from_dict(RemoteRewardConfig, options, "reward.remote"))
