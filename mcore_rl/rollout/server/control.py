"""Abort, pause/continue and memory routes of `mcore-rl-serve`, with SGLang's paths, bodies and answers: what the
trainer uses to interrupt generation around a weight update and to hand the GPU to training and back."""

from __future__ import annotations

from aiohttp import web

from mcore_rl.rollout.protocol import PAUSE_MODES
from mcore_rl.rollout.server.codec import BadRequest
from mcore_rl.rollout.server.state import engine_of, in_thread, read_body


async def abort_request(request: web.Request) -> web.Response:
    body = await read_body(request, "/abort_request")
    if body.get("abort_all"):
        engine_of(request).abort(None)
    elif body.get("rid"):
        engine_of(request).abort(str(body["rid"]))
    return web.Response(status=200)


async def pause_generation(request: web.Request) -> web.Response:
    mode = (await read_body(request, "/pause_generation")).get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise BadRequest(f"/pause_generation: mode={mode!r} not in {PAUSE_MODES}")
    await in_thread(engine_of(request).pause, mode)
    return web.json_response({"message": "Generation paused successfully."})


async def continue_generation(request: web.Request) -> web.Response:
    await read_body(request, "/continue_generation")
    engine_of(request).resume()
    return web.json_response({"message": "Generation continued successfully."})


async def flush_cache(request: web.Request) -> web.Response:
    await read_body(request, "/flush_cache")
    if engine_of(request).num_running:
        return web.Response(status=400, text="Cache not flushed because there are pending requests.")
    return web.Response(text="Cache flushed.\nPlease check backend logs for more details.")


async def release_memory(request: web.Request) -> web.Response:
    await read_body(request, "/release_memory_occupation")
    try:
        await in_thread(engine_of(request).release_memory)
    except RuntimeError as exc:
        raise BadRequest(f"/release_memory_occupation: {exc}") from None
    return web.Response(status=200)


async def resume_memory(request: web.Request) -> web.Response:
    await read_body(request, "/resume_memory_occupation")
    await in_thread(engine_of(request).resume_memory)
    return web.Response(status=200)


POST_ROUTES = {
    "/abort_request": abort_request,
    "/pause_generation": pause_generation,
    "/continue_generation": continue_generation,
}
ROUTES = {  # GET and POST, as SGLang registers them
    "/flush_cache": flush_cache,
    "/release_memory_occupation": release_memory,
    "/resume_memory_occupation": resume_memory,
}
