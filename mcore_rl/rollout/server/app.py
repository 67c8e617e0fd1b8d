"""`mcore-rl-serve`: an SGLang-compatible HTTP server over the in-process engine.

Why: the SGLang client must be tested over real HTTP in CI, where SGLang cannot run (CUDA only). This server
speaks the same field names and response shapes (see sglang_api.SGLANG_FIELDS), so the client cannot tell
the difference. Generation never blocks the event loop: handlers only queue work on the engine's worker
thread (which batches concurrent requests) and await its futures.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from typing import Any

from aiohttp import web

from mcore_rl.rollout.local.engine import LocalEngine
from mcore_rl.rollout.protocol import GenerationRequest, SamplingParams
from mcore_rl.rollout.server import chat, control, weight_update
from mcore_rl.rollout.server.auth import auth
from mcore_rl.rollout.server.codec import BadRequest, as_int_version, parse_generate, render_sample
from mcore_rl.rollout.server.state import (
    STATE,
    Limits,
    ServerState,
    TooBusy,
    engine_of,
    in_thread,
    read_body,
    reading,
    run_samples,
    writer,
)

log = logging.getLogger("mcore_rl.serve")
REQUEST_LOG = web.AppKey("request_log", Any)  # an open text stream when --log-requests is on


# ---------------------------------------------------------------------- handlers
async def generate(request: web.Request) -> web.Response:
    t0 = time.perf_counter()
    state = request.app[STATE]
    engine = state.engine
    cfg = engine.model.config
    requests, options, single = parse_generate(
        await read_body(request, "/generate"), engine.tokenizer, getattr(cfg, "max_position_embeddings", None),
        getattr(cfg, "vocab_size", None),
    )  # fmt: skip
    count = sum(r.sampling.n for r in requests)
    async with reading(state, count, "/generate"):
        samples = await run_samples(state, requests, count, "/generate")
    item_opts = [opts for req, opts in zip(requests, options) for _ in range(req.sampling.n)]
    out = [render_sample(s, o, engine, t0) for s, o in zip(samples, item_opts)]
    _log_requests(request, samples)
    return web.json_response(out[0] if single else out)


def _log_requests(request: web.Request, samples) -> None:
    """SGLang's --log-requests (json format): what this server was fed and produced, with the routing-key
    header SGLang also logs. Tests read it to see which worker served which request."""
    target = request.app.get(REQUEST_LOG)
    if target is None:
        return
    key = request.headers.get("x-smg-routing-key")
    for s in samples:
        row = {"rid": s.rid, "input_ids": s.prompt_ids, "output_ids": s.output_ids,
               "output_logprobs": s.output_logprobs, "weight_versions": s.weight_versions,
               "routing_key": key}  # fmt: skip
        target.write(json.dumps(row) + "\n")
    target.flush()


async def update_weights_from_disk(request: web.Request) -> web.Response:
    engine = engine_of(request)
    body = await read_body(request, "/update_weights_from_disk")
    if not body.get("model_path"):
        raise BadRequest("/update_weights_from_disk: model_path is required")
    version = as_int_version(body.get("weight_version"), "weight_version")
    try:
        async with writer(request.app[STATE], bool(body.get("abort_all_requests"))):
            await in_thread(engine.update_weights_from_disk, body["model_path"],
                             engine.weight_version if version is None else version)  # fmt: skip
    except (OSError, KeyError, ValueError, RuntimeError) as exc:
        msg = f"Failed to update weights: {exc}"
        return web.json_response({"success": False, "message": msg, "num_paused_requests": 0}, status=400)
    msg = f"Succeeded to update model weights (weight_version={engine.weight_version})."
    return web.json_response({"success": True, "message": msg, "num_paused_requests": 0})


async def update_weight_version(request: web.Request) -> web.Response:
    engine = engine_of(request)
    body = await read_body(request, "/update_weight_version")
    version = as_int_version(body.get("new_version"), "new_version")
    if version is None:
        raise BadRequest("/update_weight_version: new_version is required")
    if body.get("abort_all_requests", True):
        engine.abort(None)
    engine.set_weight_version(version)
    return web.json_response(
        {"success": True, "new_version": str(version), "message": "Weight version updated."}
    )


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200 if engine_of(request).health() else 503)


async def health_generate(request: web.Request) -> web.Response:
    """Run a 1-token generate (skipped while paused, where SGLang's check would hang too)."""
    engine = engine_of(request)
    if not engine.health():
        return web.Response(status=503)
    if engine.paused:
        return web.Response(status=200)
    req = GenerationRequest([engine.model.config.bos_token_id or 0], SamplingParams(max_new_tokens=1))
    try:
        await asyncio.wait_for(asyncio.wrap_future(engine.submit([req])[0]), timeout=30)
    except (TimeoutError, RuntimeError):
        return web.Response(status=503)
    return web.Response(status=200)


async def model_info(request: web.Request) -> web.Response:
    engine, info = engine_of(request), request.app[STATE].info
    return web.json_response(
        {
            "model_path": info["model_path"],
            "tokenizer_path": info["model_path"] if engine.tokenizer is not None else None,
            "is_generation": getattr(engine, "is_generation", True),
            "weight_version": str(engine.weight_version),
            "architectures": list(getattr(engine.model.config, "architectures", None) or []),
            "preferred_sampling_params": None,
        }
    )


async def server_info(request: web.Request) -> web.Response:
    engine = engine_of(request)
    return web.json_response(
        {
            **request.app[STATE].info,
            "weight_version": str(engine.weight_version),
            "max_batch_size": engine.max_batch_size,
        }
    )


async def get_weights_by_name(request: web.Request) -> web.Response:
    body = await read_body(request, "/get_weights_by_name")
    params = dict(engine_of(request).model.state_dict())
    if body.get("name") not in params:
        raise BadRequest(f"/get_weights_by_name: unknown tensor name {body.get('name')!r}")
    flat = params[body["name"]].detach().float().flatten()[: int(body.get("truncate_size", 100))]
    return web.json_response(flat.tolist())


@web.middleware
async def errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as exc:
        log.warning("400 %s: %s", request.path, exc)
        return web.json_response({"error": {"message": str(exc)}}, status=400)
    except TooBusy as exc:
        log.warning("429 %s: %s", request.path, exc)
        return web.json_response({"error": {"message": str(exc)}}, status=429)


def build_app(
    engine: LocalEngine,
    info: dict[str, Any],
    close_engine: bool = True,
    *,
    limits: Limits | None = None,
    api_key: str | None = None,
    weight_group_timeout_s: float = weight_update.GROUP_TIMEOUT_S,
    request_log: str | None = None,
) -> web.Application:
    """request_log: "stdout" or a file to append one JSON line per generated sample to (None: off)."""
    limits = limits or Limits()
    app = web.Application(middlewares=[auth, errors], client_max_size=limits.max_body_bytes)
    app[STATE] = ServerState(engine, info, limits, api_key or None)
    app[weight_update.GROUP_TIMEOUT] = float(weight_group_timeout_s)
    app.on_cleanup.append(weight_update.close_groups)
    if request_log is not None:
        app[REQUEST_LOG] = sys.stdout if request_log == "stdout" else open(request_log, "a")  # noqa: SIM115
    post = {
        "/generate": generate,
        "/update_weights_from_disk": update_weights_from_disk,
        "/update_weight_version": update_weight_version,
        chat.ENDPOINT: chat.chat_completions,
        **control.POST_ROUTES,
        **weight_update.ROUTES,
    }
    both = {**control.ROUTES, "/get_weights_by_name": get_weights_by_name}
    get = {
        "/health": health,
        "/health_generate": health_generate,
        "/model_info": model_info,
        "/get_model_info": model_info,
        "/server_info": server_info,
        "/get_server_info": server_info,
    }
    app.add_routes([web.post(p, h) for p, h in {**post, **both}.items()])
    app.add_routes([web.get(p, h) for p, h in {**get, **both}.items()])

    async def _close(_: web.Application) -> None:
        await in_thread(engine.close)

    if close_engine:
        app.on_cleanup.append(_close)
    return app
