"""Per-server state shared by the route modules: limits, the model-update lock, request bodies checked against
SGLang's field table."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from mcore_rl.rollout.local.engine import LocalEngine
from mcore_rl.rollout.server.codec import BadRequest
from mcore_rl.rollout.sglang.api import _KIND as KINDS
from mcore_rl.rollout.sglang.api import SGLANG_TYPES, type_error

log = logging.getLogger("mcore_rl.serve")


class TooBusy(Exception):
    """More work than the server's limits allow: HTTP 429 (try later or split the request)."""


@dataclass
class Limits:
    """What one server takes on. Why: a single oversized or runaway client must not take the server down."""

    max_body_bytes: int = 64 * 2**20  # 413 above this
    max_samples_per_request: int = 4096  # prompts x n in one /generate; 429 above this
    max_queued_samples: int = (
        16384  # samples accepted but not finished, all requests together; 429 above this
    )


@dataclass
class ServerState:
    engine: LocalEngine
    info: dict[str, Any]
    limits: Limits = field(default_factory=Limits)
    api_key: str | None = None
    queued: int = 0
    ignored_fields: set[tuple[str, str]] = field(default_factory=set)
    # SGLang's model_update_lock: every /generate holds the reader side for its whole life; a weight update with
    # abort_all_requests aborts them all, then takes the writer side (new /generate calls wait) - no request
    # ever sees two weight versions. `readers` counts /generate calls inside; `open` is cleared by a writer.
    readers: int = 0
    open: asyncio.Event = field(default_factory=asyncio.Event)
    idle: asyncio.Condition = field(default_factory=asyncio.Condition)

    # SGLang 0.5.23's weight-update session (selector while open) and its named broadcast groups
    session: str | None = None
    groups: dict[str, Any] = field(default_factory=dict)
    tp_rank: int = 0  # the stand-in is one TP rank

    def __post_init__(self) -> None:
        self.open.set()


STATE = web.AppKey("state", ServerState)


def engine_of(request: web.Request) -> LocalEngine:
    return request.app[STATE].engine


async def read_body(request: web.Request, endpoint: str) -> dict[str, Any]:
    body = await read_json(request, endpoint, SGLANG_TYPES[endpoint])
    err = type_error(endpoint, body)
    if err:
        raise BadRequest(err)
    return body


async def read_json(request: web.Request, endpoint: str, known: Iterable[str]) -> dict[str, Any]:
    """The body as a JSON object (400 otherwise); fields not in `known` are ignored, as SGLang's request models
    ignore them (logged once per endpoint and name)."""
    raw = await request.read()  # aiohttp answers 413 itself above client_max_size
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"{endpoint}: body is not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(body, dict):
        raise BadRequest(f"{endpoint}: body must be a JSON object, got {type(body).__name__}")
    state = request.app[STATE]
    for name in set(body) - set(known):
        if (endpoint, name) not in state.ignored_fields:
            state.ignored_fields.add((endpoint, name))
            log.debug("%s: ignoring unknown top-level field %r (logged once)", endpoint, name)
    return body


def kind_error(endpoint: str, table: dict[str, tuple[str, ...]], body: dict[str, Any]) -> str | None:
    """The first field of `body` whose JSON type is not one of its kinds in `table` (sglang/api.py's kinds)."""
    for name, value in body.items():
        kinds = table.get(name)
        if kinds is not None and value is not None and not any(KINDS[k](value) for k in kinds):
            return f"{endpoint}: field {name!r} must be {' or '.join(kinds)}, got {type(value).__name__}"
    return None


@asynccontextmanager
async def reading(state: ServerState, count: int, endpoint: str):
    """Admit `count` samples under the limits (429 above them), then hold the reader side of the model-update
    lock for the request's whole life (SGLang's model_update_lock: no request sees two weight versions)."""
    lim = state.limits
    if count > lim.max_samples_per_request:
        raise TooBusy(
            f"{endpoint}: {count} samples (prompts x n) > max_samples_per_request={lim.max_samples_per_request}"
        )
    if state.queued + count > lim.max_queued_samples:
        raise TooBusy(
            f"{endpoint}: {state.queued} samples queued + {count} > max_queued_samples={lim.max_queued_samples}"
        )
    await state.open.wait()  # a weight update holds the writer side
    state.readers += 1
    try:
        yield
    finally:
        state.readers -= 1
        async with state.idle:
            state.idle.notify_all()


async def run_samples(state: ServerState, requests: list, count: int, endpoint: str) -> list:
    """Queue `requests` on the engine's worker and await their Samples; a client that goes away frees its slots."""
    engine = state.engine
    try:
        futures = engine.submit(requests)
    except (RuntimeError, ValueError) as exc:
        raise BadRequest(f"{endpoint}: {exc}") from None
    state.queued += count
    try:
        return await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
    except asyncio.CancelledError:
        for req in requests:
            engine.abort(req.rid)
        raise
    finally:
        state.queued -= count


async def in_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


@asynccontextmanager
async def writer(state: ServerState, abort_all: bool):
    """abort_all_requests: abort everything in flight, then hold the writer side of SGLang's model_update_lock
    (wait until the aborted /generate calls have answered; new ones wait until the update is done). A paused
    server updates at once, as SGLang does (no lock while paused)."""
    if not abort_all:
        yield
        return
    state.engine.abort(None)
    if state.engine.paused:
        yield
        return
    state.open.clear()
    try:
        async with state.idle:
            await state.idle.wait_for(lambda: state.readers == 0)
        yield
    finally:
        state.open.set()
