"""A stand-in for SGLang's `/classify` and OpenAI's `/v1/chat/completions`, for the rm and judge client tests.

aiohttp on 127.0.0.1 only, in a thread of its own, stopped by the test. Every request's route, body and headers are
kept. What it answers is chosen by the test: `classify(ids) -> logits` per row, `chat(body) -> (content,
top_logprobs)` per request. Misbehaviour, so tests stay deterministic under concurrency: the first `fail_first`
requests answer 500; a body holding the text `hang_marker` sleeps `hang_s` (past the client's timeout); a body
holding `garbage_marker` answers JSON that is not the route's shape; with `api_key` set, a request without the
bearer header gets 401. The answer shapes are SGLang 0.5.23's: `/classify` with a batch of `input_ids` -> a list of
`{"embedding": [...], "meta_info": {...}}`; `/v1/chat/completions` -> `ChatCompletionResponse` with
`choices[0].logprobs.content[0].top_logprobs` as `[{"token", "bytes", "logprob"}]` (`ChoiceLogprobs`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tests.rewards.threaded_app import ThreadedApp


def _default_classify(ids: list[int]) -> list[float]:
    return [float(len(ids)), float(sum(ids) % 97)]


def _default_chat(body: dict) -> tuple[str, list[tuple[str, float]] | None]:
    return "yes", [("yes", -0.1), ("no", -2.4)]


@dataclass
class StandIn:
    classify: Callable[[list[int]], list[float]] = _default_classify
    chat: Callable[[dict], tuple[str, list[tuple[str, float]] | None]] = _default_chat
    api_key: str | None = None
    fail_first: int = 0
    hang_marker: str | None = None
    hang_s: float = 5.0
    garbage_marker: str | None = None
    requests: list[tuple[str, dict, dict]] = field(default_factory=list)  # (route, body, headers)
    max_in_flight: int = 0
    _in_flight: int = 0

    def __enter__(self) -> StandIn:
        self._app = ThreadedApp()
        self.port = self._app.start({"/classify": self._handle, "/v1/chat/completions": self._handle})
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self._app.stop()

    def bodies(self, route: str) -> list[dict]:
        return [b for r, b, _ in self.requests if r == route]

    async def _handle(self, request):
        from aiohttp import web

        raw = (await request.read()).decode()
        body = json.loads(raw)
        self.requests.append((request.path, body, dict(request.headers)))
        number = len(self.requests)  # arrival order, fixed before any await
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.Response(status=401)
        self._in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self._in_flight)
        try:
            await asyncio.sleep(0.02)
            if number <= self.fail_first:
                return web.Response(status=500, text="busy")
            if self.hang_marker and self.hang_marker in raw:
                await asyncio.sleep(self.hang_s)
            if self.garbage_marker and self.garbage_marker in raw:
                return web.json_response({"object": "error", "detail": "not what you asked for"})
            if request.path == "/classify":
                return web.json_response(self._classify(body))
            return web.json_response(self._chat(body))
        finally:
            self._in_flight -= 1

    def _classify(self, body: dict) -> list[dict]:
        return [
            {"embedding": self.classify(ids), "meta_info": {"id": f"r{i}", "prompt_tokens": len(ids)}}
            for i, ids in enumerate(body["input_ids"])
        ]

    def _chat(self, body: dict) -> dict:
        content, top = self.chat(body)
        logprobs = None
        if body.get("logprobs") and top:
            alts = [
                {"token": t, "bytes": list(t.encode()), "logprob": lp}
                for t, lp in top[: body["top_logprobs"]]
            ]
            logprobs = {"content": [{**alts[0], "top_logprobs": alts}]}
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": content},
            "logprobs": logprobs,
            "finish_reason": "stop",
        }
        return {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "default"),
            "choices": [choice],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
