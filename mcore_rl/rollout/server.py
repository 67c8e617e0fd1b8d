"""`mcore-rl-serve`: an SGLang-compatible HTTP server over the in-process engine.

Why: the SGLang client must be tested over real HTTP in CI, where SGLang cannot run (CUDA only). This server
speaks the same field names and response shapes (see sglang_api.SGLANG_FIELDS), so the client cannot tell
the difference. Generation never blocks the event loop: handlers only queue work on the engine's worker
thread (which batches concurrent requests) and await its futures.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from mcore_rl.rollout.local import LocalEngine
from mcore_rl.rollout.protocol import PAUSE_MODES, GenerationRequest, SamplingParams
from mcore_rl.rollout.server_codec import BadRequest, as_int_version, parse_generate, render_sample
from mcore_rl.rollout.sglang_api import unknown_fields

log = logging.getLogger("mcore_rl.serve")
ENGINE = web.AppKey("engine", LocalEngine)
INFO = web.AppKey("info", dict)


async def _body(request: web.Request, endpoint: str) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = await request.json()
    except ValueError as exc:
        raise BadRequest(f"{endpoint}: body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise BadRequest(f"{endpoint}: body must be a JSON object")
    bad = unknown_fields(endpoint, body)
    if bad:
        raise BadRequest(f"{endpoint}: unknown field(s) {bad}")
    return body


# ---------------------------------------------------------------------- handlers
async def generate(request: web.Request) -> web.Response:
    t0 = time.perf_counter()
    engine = request.app[ENGINE]
    requests, options, single = parse_generate(await _body(request, "/generate"), engine.tokenizer)
    try:
        futures = engine.submit(requests)
    except (RuntimeError, ValueError) as exc:
        raise BadRequest(f"/generate: {exc}") from None
    item_opts = [opts for req, opts in zip(requests, options) for _ in range(req.sampling.n)]
    try:
        samples = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
    except asyncio.CancelledError:  # client went away: free the batch slots
        for req in requests:
            engine.abort(req.rid)
        raise
    out = [render_sample(s, o, engine, t0) for s, o in zip(samples, item_opts)]
    return web.json_response(out[0] if single else out)


async def _in_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def update_weights_from_disk(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = await _body(request, "/update_weights_from_disk")
    if not body.get("model_path"):
        raise BadRequest("/update_weights_from_disk: model_path is required")
    version = as_int_version(body.get("weight_version"), "weight_version")
    if body.get("abort_all_requests"):
        engine.abort(None)
    try:
        await _in_thread(
            engine.update_weights_from_disk, body["model_path"], version or engine.weight_version
        )
    except (OSError, KeyError, ValueError, RuntimeError) as exc:
        msg = f"Failed to update weights: {exc}"
        return web.json_response({"success": False, "message": msg, "num_paused_requests": 0}, status=400)
    msg = f"Succeeded to update model weights (weight_version={engine.weight_version})."
    return web.json_response({"success": True, "message": msg, "num_paused_requests": 0})


async def update_weight_version(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = await _body(request, "/update_weight_version")
    version = as_int_version(body.get("new_version"), "new_version")
    if version is None:
        raise BadRequest("/update_weight_version: new_version is required")
    if body.get("abort_all_requests", True):
        engine.abort(None)
    engine.set_weight_version(version)
    return web.json_response(
        {"success": True, "new_version": str(version), "message": "Weight version updated."}
    )


async def abort_request(request: web.Request) -> web.Response:
    body = await _body(request, "/abort_request")
    if body.get("abort_all"):
        request.app[ENGINE].abort(None)
    elif body.get("rid"):
        request.app[ENGINE].abort(str(body["rid"]))
    return web.Response(status=200)


async def pause_generation(request: web.Request) -> web.Response:
    mode = (await _body(request, "/pause_generation")).get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise BadRequest(f"/pause_generation: mode={mode!r} not in {PAUSE_MODES}")
    await _in_thread(request.app[ENGINE].pause, mode)
    return web.json_response({"message": "Generation paused successfully."})


async def continue_generation(request: web.Request) -> web.Response:
    await _body(request, "/continue_generation")
    request.app[ENGINE].resume()
    return web.json_response({"message": "Generation continued successfully."})


async def flush_cache(request: web.Request) -> web.Response:
    await _body(request, "/flush_cache")
    if request.app[ENGINE].num_running:
        return web.Response(status=400, text="Cache not flushed because there are pending requests.")
    return web.Response(text="Cache flushed.\nPlease check backend logs for more details.")


async def release_memory(request: web.Request) -> web.Response:
    await _body(request, "/release_memory_occupation")
    try:
        await _in_thread(request.app[ENGINE].release_memory)
    except RuntimeError as exc:
        raise BadRequest(f"/release_memory_occupation: {exc}") from None
    return web.Response(status=200)


async def resume_memory(request: web.Request) -> web.Response:
    await _body(request, "/resume_memory_occupation")
    await _in_thread(request.app[ENGINE].resume_memory)
    return web.Response(status=200)


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200 if request.app[ENGINE].health() else 503)


async def health_generate(request: web.Request) -> web.Response:
    """Run a 1-token generate (skipped while paused, where SGLang's check would hang too)."""
    engine = request.app[ENGINE]
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
    engine, info = request.app[ENGINE], request.app[INFO]
    return web.json_response(
        {
            "model_path": info["model_path"],
            "tokenizer_path": info["model_path"] if engine.tokenizer is not None else None,
            "is_generation": True,
            "weight_version": str(engine.weight_version),
            "architectures": list(getattr(engine.model.config, "architectures", None) or []),
            "preferred_sampling_params": None,
        }
    )


async def server_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.json_response(
        {
            **request.app[INFO],
            "weight_version": str(engine.weight_version),
            "max_batch_size": engine.max_batch_size,
        }
    )


async def get_weights_by_name(request: web.Request) -> web.Response:
    body = await _body(request, "/get_weights_by_name")
    params = dict(request.app[ENGINE].model.state_dict())
    if body.get("name") not in params:
        raise BadRequest(f"/get_weights_by_name: unknown tensor name {body.get('name')!r}")
    flat = params[body["name"]].detach().float().flatten()[: int(body.get("truncate_size", 100))]
    return web.json_response(flat.tolist())


async def not_supported(request: web.Request) -> web.Response:
    await _body(request, request.path)  # unknown fields still get their 400 first
    raise BadRequest(
        f"{request.path} is not supported by mcore-rl-serve (no NCCL/CUDA IPC); use /update_weights_from_disk"
    )


@web.middleware
async def errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as exc:
        log.warning("400 %s: %s", request.path, exc)
        return web.json_response({"error": {"message": str(exc)}}, status=400)


def build_app(engine: LocalEngine, info: dict[str, Any], close_engine: bool = True) -> web.Application:
    app = web.Application(middlewares=[errors], client_max_size=1 << 30)
    app[ENGINE], app[INFO] = engine, info
    post = {
        "/generate": generate,
        "/update_weights_from_disk": update_weights_from_disk,
        "/update_weight_version": update_weight_version,
        "/abort_request": abort_request,
        "/pause_generation": pause_generation,
        "/continue_generation": continue_generation,
        "/update_weights_from_tensor": not_supported,
        "/init_weights_update_group": not_supported,
        "/update_weights_from_distributed": not_supported,
        "/destroy_weights_update_group": not_supported,
    }
    both = {
        "/flush_cache": flush_cache,
        "/release_memory_occupation": release_memory,
        "/resume_memory_occupation": resume_memory,
        "/get_weights_by_name": get_weights_by_name,
    }
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
        await _in_thread(engine.close)

    if close_engine:
        app.on_cleanup.append(_close)
    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="SGLang-compatible HTTP server over the mcore-rl local engine")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--weight-version", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    engine = LocalEngine(
        args.model_path, device=args.device, dtype=args.dtype, num_threads=args.num_threads,
        max_batch_size=args.max_batch_size, seed=args.seed, weight_version=args.weight_version,
    )  # fmt: skip
    info = {
        "model_path": args.model_path, "host": args.host, "port": args.port, "tp_size": 1, "dp_size": 1,
        "device": args.device, "dtype": args.dtype, "version": "mcore-rl-serve/0.1",
    }  # fmt: skip
    log.info("mcore-rl-serve: http://%s:%d  model=%s", args.host, args.port, args.model_path)
    web.run_app(
        build_app(engine, info), host=args.host, port=args.port, print=None, handler_cancellation=True
    )


if __name__ == "__main__":
    main()
