"""A reward service for tests, shaped like OpenRLHF's reference server (`openrlhf/cli/serve_rm.py`, POST /get_reward):
aiohttp on 127.0.0.1 only, in a thread of its own, stopped by the test. Every request body and header is kept.

Scoring: 1.0 when the last number of the response (the query after its prompt) equals the label, else 0.0. What the
server does instead is chosen by markers, so tests stay deterministic under concurrency: a query holding "HANG"
sleeps (at most `hang_s`), "MALFORMED" answers a bare list, "FAIL_ONCE" answers 500 the first time that body is
seen; the `fail_first` first requests of the server answer 500; `bad_requests` (1-based arrival numbers) answer
a body without `rewards`; with `api_key` set, a request without the bearer header gets 401.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field

from tests.rewards.threaded_app import ThreadedApp


@dataclass
class RewardServer:
    api_key: str | None = None
    hang_s: float = 10.0
    fail_first: int = 0
    bad_requests: tuple[int, ...] = ()
    delay_s: float = 0.0
    bodies: list[dict] = field(default_factory=list)
    headers: list[dict] = field(default_factory=list)
    down_bodies: list[dict] = field(default_factory=list)  # what POST /down (always 503) received
    max_in_flight: int = 0
    _in_flight: int = 0
    _seen: set = field(default_factory=set)

    def __enter__(self) -> RewardServer:
        self._app = ThreadedApp()
        self.port = self._app.start({"/get_reward": self._handle, "/down": self._down})
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/get_reward"

    def __exit__(self, *exc) -> None:
        self._app.stop()

    async def _down(self, request):
        from aiohttp import web

        self.down_bodies.append(await request.json())
        return web.Response(status=503)

    async def _handle(self, request):
        from aiohttp import web

        raw = await request.read()
        body = json.loads(raw)
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        number = len(self.bodies)
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.Response(status=401)
        self._in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self._in_flight)
        try:
            await asyncio.sleep(self.delay_s)
            if number <= self.fail_first or ("FAIL_ONCE" in raw.decode() and raw not in self._seen):
                self._seen.add(raw)
                return web.Response(status=500, text="busy")
            if any("HANG" in q for q in body["query"]):
                await asyncio.sleep(self.hang_s)
            if any("MALFORMED" in q for q in body["query"]):
                return web.json_response([1.0] * len(body["query"]))
            if number in self.bad_requests:
                return web.json_response({"scores": [0.0] * len(body["query"])})
            return web.json_response(score(body))
        finally:
            self._in_flight -= 1


def score(body: dict) -> dict:
    """OpenRLHF's response shape: rewards, scores, extra_logs (per-query lists)."""
    rewards, lengths = [], []
    for query, prompt, label in zip(body["query"], body["prompts"], body["labels"]):
        response = query[len(prompt):] if query.startswith(prompt) else query
        numbers = re.findall(r"-?\d+", response)
        rewards.append(1.0 if numbers and numbers[-1] == str(label) else 0.0)
        lengths.append(float(len(response)))
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"response_chars": lengths}}
