"""`mcore-rl-serve --is-embedding`: SGLang 0.5.23's `/classify` (and `/encode`) over a reward model.

Wire format read from the sglang 0.5.23 wheel: the request is `EmbeddingReqInput` (srt/managers/io_struct.py:
`text` or `input_ids`, one item or a batch, `rid`; `sampling_params` is a dummy), normalised as its
`normalize_batch_and_arguments` does; the answer is the tokenizer manager's embedding output (srt/managers/
tokenizer_manager.py, `BatchEmbeddingOutput` branch): per item `{"embedding": [logits], "meta_info": {...}}`, a list
for a batch. Errors are `{"error": {"message": ...}}` with 400, SGLang's `_create_error_response`. Fields this server
cannot honour (images, LoRA, Matryoshka dimensions, ...) are a 400 naming the field, never silently dropped.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from aiohttp import web

from mcore_rl.rollout.server.app import errors, model_info, server_info
from mcore_rl.rollout.server.auth import auth
from mcore_rl.rollout.server.codec import BadRequest
from mcore_rl.rollout.server.reward_model import RewardModelServer
from mcore_rl.rollout.server.state import (
    STATE,
    Limits,
    ServerState,
    in_thread,
    kind_error,
    read_json,
    reading,
)

# EmbeddingReqInput fields served, with their JSON kinds.
CLASSIFY_TYPES: dict[str, tuple[str, ...]] = {
    "text": ("str", "list[str]"), "input_ids": ("list[int]", "list[list[int]]"), "rid": ("str", "list[str]"),
    "sampling_params": ("dict", "list[dict]"),  # SGLang's "dummy sampling params for compatibility": unused
    "log_metrics": ("bool",), "priority": ("int",), "routing_key": ("str",), "return_prompt_token_ids": ("bool",),
}  # fmt: skip
# EmbeddingReqInput fields accepted only at their default: anything else changes the answer, so it is a 400.
CLASSIFY_NEUTRAL: dict[str, Any] = {
    "input_embeds": None, "image_data": None, "video_data": None, "audio_data": None, "modalities": None,
    "embed_override_token_id": None, "embed_overrides": None, "is_cross_encoder_request": False, "lora_path": None,
    "return_pooled_hidden_states": False, "multi_item_delimiter_indices": None, "token_indices_to_pool": None,
    "background": False,
}  # fmt: skip
# SGLang's own words for two of them (tokenizer_manager._validate_for_matryoshka_dim, http_server).
_REFUSALS = {
    "decision_layout": "decision_layout is set only by /v1/systemone",
    "dimensions": "Model '{path}' does not support matryoshka representation, changing output dimensions will "
    "lead to poor results.",
}
NOT_GENERATION = (
    "/generate: this server runs a classification model (--is-embedding); it answers /classify and /encode"
)


def _refuse(body: dict[str, Any], endpoint: str, model_path: str) -> None:
    err = kind_error(endpoint, CLASSIFY_TYPES, body)
    if err:
        raise BadRequest(err)
    for key, neutral in CLASSIFY_NEUTRAL.items():
        if body.get(key, neutral) not in (neutral, None):
            raise BadRequest(f"{endpoint}: {key}={body[key]!r} is not supported by mcore-rl-serve")
    for key, msg in _REFUSALS.items():
        if body.get(key) is not None:
            raise BadRequest(f"{endpoint}: " + msg.format(path=model_path))


def _rows(body: dict[str, Any], endpoint: str, server: RewardModelServer) -> tuple[list[list[int]], bool]:
    """(token rows, single) as SGLang normalises them: a str / flat id list is one item, a list a batch."""
    text, ids = body.get("text"), body.get("input_ids")
    if text is None and ids is None:
        raise BadRequest(
            f"{endpoint}: At least one of text, input_ids, image, video, or audio should be provided"
        )
    if text is not None and ids is not None:
        raise BadRequest(f"{endpoint}: text and input_ids cannot be provided at the same time")
    if text is not None:
        if server.tokenizer is None:
            raise BadRequest(f"{endpoint}: text input needs a tokenizer; this model folder has none")
        single = isinstance(text, str)
        rows = [server.tokenizer(t)["input_ids"] for t in ([text] if single else text)]
    else:
        single = bool(ids) and not isinstance(ids[0], list)
        rows = [ids] if single else list(ids)
    if not rows:
        raise BadRequest(f"{endpoint}: empty batch")
    for i, row in enumerate(rows):
        if not row:
            raise BadRequest(f"{endpoint}: item {i} has no tokens")
        if any(not 0 <= t < server.vocab_size for t in row):
            raise BadRequest(
                f"{endpoint}: input_ids[{i}] has token ids out of range [0, {server.vocab_size})"
            )
        if len(row) >= server.context_len:
            raise BadRequest(
                f"{endpoint}: The input ({len(row)} tokens) is longer than the model's context length "
                f"({server.context_len} tokens)."
            )
    return rows, single


def _rids(rid: Any, n: int, single: bool, endpoint: str) -> list[str]:
    if single:
        if isinstance(rid, list):
            raise BadRequest(f"{endpoint}: rid must be a string for a single input")
        return [rid or uuid.uuid4().hex]
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if not isinstance(rid, list):
        raise BadRequest(f"{endpoint}: The rid should be a list.")
    if len(rid) != n:
        raise BadRequest(f"{endpoint}: rid has {len(rid)} entries for a batch of {n}")
    if len(set(rid)) != n:
        dup = sorted({r for r in rid if rid.count(r) > 1})
        raise BadRequest(f"{endpoint}: Duplicate request IDs detected within the request: {dup}")
    return list(rid)


def render(
    scores: list[list[float]], rows: list[list[int]], rids: list[str], server, t0: float
) -> list[dict]:
    """SGLang's embedding output: meta_info as the tokenizer manager builds it for a `BatchEmbeddingOutput`. The
    finish reason is what its scheduler gives an embedding request (one dummy output token 0 under
    max_new_tokens=0: a length finish, or a stop when 0 is an EOS id)."""
    finish = {"type": "stop", "matched": 0} if 0 in server.eos_ids else {"type": "length", "length": 0}
    latency = time.perf_counter() - t0
    return [
        {
            "embedding": s,
            "meta_info": {
                "id": rid,
                "finish_reason": dict(finish),
                "prompt_tokens": len(row),
                "weight_version": str(server.weight_version),
                "num_retractions": 0,
                "e2e_latency": latency,
            },
        }  # fmt: skip
        for s, row, rid in zip(scores, rows, rids)
    ]


async def classify(request: web.Request) -> web.Response:
    """POST/PUT /classify and /encode: one forward per queued batch on the server's worker thread."""
    t0 = time.perf_counter()
    endpoint = request.path
    state = request.app[STATE]
    server: RewardModelServer = state.engine
    body = await read_json(request, endpoint, {*CLASSIFY_TYPES, *CLASSIFY_NEUTRAL, *_REFUSALS})
    _refuse(body, endpoint, server.model_path)
    rows, single = _rows(body, endpoint, server)
    rids = _rids(body.get("rid"), len(rows), single, endpoint)
    async with reading(state, len(rows), endpoint):
        state.queued += len(rows)
        try:
            scores = await asyncio.wrap_future(server.submit(rows))
        except RuntimeError as exc:
            raise BadRequest(f"{endpoint}: {exc}") from None
        finally:
            state.queued -= len(rows)
    out = render(scores, rows, rids, server, t0)
    return web.json_response(out[0] if single else out)


async def not_generation(request: web.Request) -> web.Response:
    raise BadRequest(NOT_GENERATION)


async def health_generate(request: web.Request) -> web.Response:
    """SGLang's check for an embedding server: one forward of input_ids=[0]."""
    server: RewardModelServer = request.app[STATE].engine
    if not server.health():
        return web.Response(status=503)
    try:
        await asyncio.wait_for(asyncio.wrap_future(server.submit([[0]])), timeout=30)
    except (TimeoutError, RuntimeError):
        return web.Response(status=503)
    return web.Response(status=200)


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200 if request.app[STATE].engine.health() else 503)


def build_embedding_app(
    server: RewardModelServer,
    info: dict[str, Any],
    close_engine: bool = True,
    *,
    limits: Limits | None = None,
    api_key: str | None = None,
) -> web.Application:
    """The routes SGLang serves for an `--is-embedding` model that this server implements."""
    limits = limits or Limits()
    app = web.Application(middlewares=[auth, errors], client_max_size=limits.max_body_bytes)
    app[STATE] = ServerState(server, info, limits, api_key or None)
    for path in ("/classify", "/encode"):
        app.add_routes([web.post(path, classify), web.put(path, classify)])
    app.add_routes([web.post("/generate", not_generation), web.put("/generate", not_generation)])
    get = {"/health": health, "/health_generate": health_generate, "/model_info": model_info,
           "/get_model_info": model_info, "/server_info": server_info, "/get_server_info": server_info}  # fmt: skip
    app.add_routes([web.get(p, h) for p, h in get.items()])

    async def _close(_: web.Application) -> None:
        await in_thread(server.close)

    if close_engine:
        app.on_cleanup.append(_close)
    return app
