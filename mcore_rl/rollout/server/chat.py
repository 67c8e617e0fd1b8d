"""`/v1/chat/completions` of `mcore-rl-serve`, as SGLang 0.5.23 serves it (srt/entrypoints/openai/serving_chat.py,
protocol.py): what an LLM judge calls.

The prompt is the model's own chat template rendered to text (add_generation_prompt=True, the request's
`chat_template_kwargs`) and encoded without special tokens, as SGLang's jinja path does. Sampling fields map as its
`ChatCompletionRequest.to_sampling_params` maps them (request value > the model's generation_config > OpenAI
defaults); `logprobs` / `top_logprobs` are the sampled token's log-prob and the k largest of the same distribution,
log_softmax(logits / T) (T = 1 when greedy), per output token. The answer is `ChatCompletionResponse`'s JSON; errors
are its `ErrorResponse` (`{"object": "error", "message", "type", "param", "code"}`) with 400. Fields this engine
cannot honour (penalties, tools, grammars, min_p > 0, streaming) are a 400 naming the field.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

from mcore_rl.rollout.local.rows import OUTPUT_TOP_LOGPROBS, TOP_LOGPROBS_NUM
from mcore_rl.rollout.protocol import GenerationRequest, Sample, SamplingParams
from mcore_rl.rollout.server.codec import BadRequest
from mcore_rl.rollout.server.state import STATE, kind_error, read_json, reading, run_samples

ENDPOINT = "/v1/chat/completions"
# ChatCompletionRequest fields served, with their JSON kinds.
CHAT_TYPES: dict[str, tuple[str, ...]] = {
    "messages": ("list[dict]",), "model": ("str",), "max_tokens": ("int",), "max_completion_tokens": ("int",),
    "temperature": ("number",), "top_p": ("number",), "top_k": ("int",), "min_p": ("number",), "n": ("int",),
    "stop": ("str", "list[str]"), "seed": ("int",), "logprobs": ("bool",), "top_logprobs": ("int",),
    "stream": ("bool",), "stop_token_ids": ("list[int]",), "ignore_eos": ("bool",), "skip_special_tokens": ("bool",),
    "no_stop_trim": ("bool",), "rid": ("str",), "chat_template_kwargs": ("dict",), "user": ("str",),
    "tool_choice": ("str", "dict"),
}  # fmt: skip
# ChatCompletionRequest fields accepted only at their default (null is always accepted).
CHAT_NEUTRAL: dict[str, Any] = {
    "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0,
    "logit_bias": None, "response_format": None, "tools": None, "regex": None, "ebnf": None, "stop_regex": None,
    "lora_path": None, "continue_final_message": False, "stream": False, "stream_options": None,
    "return_hidden_states": False, "return_token_ids": False, "return_prompt_token_ids": False,
    "return_meta_info": False, "input_ids": None, "custom_logit_processor": None, "session_id": None,
}  # fmt: skip
OPENAI_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
}  # ChatCompletionRequest._DEFAULT_SAMPLING_PARAMS
ROLES = ("system", "developer", "user", "assistant", "tool")


def _refuse(body: dict[str, Any]) -> None:
    err = kind_error(ENDPOINT, CHAT_TYPES, body)
    if err:
        raise BadRequest(err)
    for key, neutral in CHAT_NEUTRAL.items():
        if body.get(key, neutral) not in (neutral, None):
            raise BadRequest(f"{ENDPOINT}: {key}={body[key]!r} is not supported by mcore-rl-serve")
    if body.get("tool_choice", "none") not in ("none", "auto", None):
        raise BadRequest("Tools cannot be empty if tool choice is set to required.")
    if "chat_template" in (body.get("chat_template_kwargs") or {}):  # SGLang's refusal without its trust flag
        raise BadRequest(
            "Request-supplied chat_template is not allowed. Start the server with --trust-request-chat-template "
            "to permit it."
        )


def _messages(raw: Any) -> list[dict[str, Any]]:
    """Messages as the template reads them: text parts of a list content joined with a space (SGLang's 'string'
    content format); other parts (images, audio) are refused."""
    if not raw:
        raise BadRequest("Messages cannot be empty.")
    out = []
    for i, msg in enumerate(raw):
        role, content = msg.get("role"), msg.get("content")
        if role not in ROLES:
            raise BadRequest(f"{ENDPOINT}: messages[{i}].role={role!r} not in {ROLES}")
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") not in ("text", "input_text") for p in content):
                raise BadRequest(f"{ENDPOINT}: messages[{i}].content: only text parts are supported")
            content = " ".join(str(p.get("text", "")) for p in content)
        elif content is not None and not isinstance(content, str):
            raise BadRequest(f"{ENDPOINT}: messages[{i}].content must be a string or a list of text parts")
        out.append({k: v for k, v in {**msg, "content": content}.items() if v is not None})
    return out


def _prompt(engine, body: dict[str, Any]) -> list[int]:
    tok = engine.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise BadRequest(f"{ENDPOINT}: the model folder has no tokenizer with a chat template")
    try:
        text = tok.apply_chat_template(_messages(body.get("messages")), tokenize=False, add_generation_prompt=True,
                                       **(body.get("chat_template_kwargs") or {}))  # fmt: skip
    except BadRequest:
        raise
    except Exception as exc:  # a template's own raise_exception(), bad kwargs: the request's fault
        raise BadRequest(f"{ENDPOINT}: chat template: {str(exc).splitlines()[0][:300]}") from None
    return tok.encode(text, add_special_tokens=False)


def _sampling(engine, body: dict[str, Any], prompt_len: int) -> SamplingParams:
    ctx = int(getattr(engine.model.config, "max_position_embeddings", 1 << 30))
    max_out = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_out is not None and max_out < 0:
        raise BadRequest(f"{ENDPOINT}: max_new_tokens must be at least 0, got {max_out}.")
    if max_out is not None and max_out > ctx:
        raise BadRequest(f"max_completion_tokens is too large: {max_out}.This model supports at most {ctx} "
                         "completion tokens.")  # fmt: skip
    if max_out is not None and prompt_len + max_out > ctx:
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You requested a "
            f"total of {prompt_len + max_out} tokens: {prompt_len} tokens from the input messages and {max_out} "
            "tokens for the completion. Please reduce the number of tokens in the input messages or the completion "
            "to fit within the limit."
        )
    gen = getattr(engine.model, "generation_config", None)
    model_defaults = {k: v for k, v in (gen.to_dict() if gen is not None else {}).items() if v is not None}

    def pick(name: str):
        value = body.get(name)
        return value if value is not None else model_defaults.get(name, OPENAI_DEFAULTS[name])

    stop = body.get("stop")
    top_k = min(int(pick("top_k")), int(engine.model.config.vocab_size))  # the same distribution; fits int64
    try:
        return SamplingParams(
            max_new_tokens=max(1, max_out if max_out is not None else ctx - prompt_len - 1),
            temperature=float(pick("temperature")), top_p=float(pick("top_p")), top_k=top_k,
            stop=[stop] if isinstance(stop, str) else list(stop or []), n=1 if body.get("n") is None else body["n"],
            stop_token_ids=list(body.get("stop_token_ids") or []), seed=body.get("seed"),
            ignore_eos=bool(body.get("ignore_eos")),
        )  # fmt: skip
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"{ENDPOINT}: {exc}") from None


def parse_chat(engine, body: dict[str, Any]) -> GenerationRequest:
    """A ChatCompletionRequest body -> one GenerationRequest (n samples); 400 for what does not fit."""
    _refuse(body)
    top = body.get("top_logprobs") or 0
    vocab = int(engine.model.config.vocab_size)
    if not 0 <= top <= vocab:
        raise BadRequest(f"{ENDPOINT}: top_logprobs={top} must be in [0, {vocab}]")
    prompt = _prompt(engine, body)
    if not prompt:
        raise BadRequest(f"{ENDPOINT}: the rendered prompt has no tokens")
    meta = {TOP_LOGPROBS_NUM: top} if body.get("logprobs") and top else {}
    return GenerationRequest(prompt, _sampling(engine, body, len(prompt)), rid=body.get("rid") or uuid.uuid4().hex,
                             metadata=meta)  # fmt: skip


# ---------------------------------------------------------------------- the response
def _bytes_of(tok, token_id: int, text: str) -> list[int]:
    """OpenAI's `bytes`: a byte-level BPE token's own bytes (a fragment of a UTF-8 character stays exact), else the
    UTF-8 of its text (what SGLang's token_id_to_bytes / fallback give)."""
    piece = tok.convert_ids_to_tokens(token_id)
    table = _byte_decoder()
    if isinstance(piece, str) and piece and all(ch in table for ch in piece):
        return [table[ch] for ch in piece]
    return list(text.encode("utf-8"))


_BYTE_DECODER: dict[str, int] = {}


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE's char -> byte table: bytes that are printable Latin-1 stand for themselves, the other
    bytes take the code points from 256 up, in byte order."""
    if not _BYTE_DECODER:
        keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
        moved = [b for b in range(256) if b not in keep]
        _BYTE_DECODER.update({chr(b): b for b in keep})
        _BYTE_DECODER.update({chr(256 + i): b for i, b in enumerate(moved)})
    return _BYTE_DECODER


def _logprobs(sample: Sample, tok) -> dict[str, Any]:
    top = sample.metadata.get(OUTPUT_TOP_LOGPROBS) or []

    def entry(lp: float, tid: int) -> dict[str, Any]:
        text = tok.decode([tid])
        return {"token": text, "bytes": _bytes_of(tok, tid, text), "logprob": lp}

    content = []
    for i, (lp, tid) in enumerate(zip(sample.output_logprobs, sample.output_ids)):
        row = top[i] if i < len(top) else []
        content.append({**entry(lp, tid), "top_logprobs": [entry(v, t) for v, t in row]})
    return {"content": content}


def _text(sample: Sample, tok, body: dict[str, Any]) -> str:
    if body.get("skip_special_tokens") is False or body.get("no_stop_trim"):
        return tok.decode(sample.output_ids, skip_special_tokens=body.get("skip_special_tokens") is not False)
    return sample.text or ""


def render_chat(samples: list[Sample], body: dict[str, Any], engine, created: int) -> dict[str, Any]:
    """ChatCompletionResponse's JSON (fields its serializers drop when None are left out here too)."""
    tok = engine.tokenizer
    choices = []
    for idx, s in enumerate(samples):
        choices.append({
            "index": idx,
            "message": {"role": "assistant", "content": _text(s, tok, body), "reasoning_content": None},
            "logprobs": _logprobs(s, tok) if body.get("logprobs") else None,
            "finish_reason": s.finish_reason,
            "matched_stop": s.matched_stop if s.finish_reason == "stop" else None,
        })  # fmt: skip
    prompt_tokens = len(samples[0].prompt_ids)
    completion = sum(len(s.output_ids) for s in samples)
    version = samples[0].weight_versions[-1] if samples[0].weight_versions else engine.weight_version
    return {
        "id": samples[0].rid, "object": "chat.completion", "created": created, "model": body.get("model") or "default",
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion,
                  "completion_tokens": completion, "prompt_tokens_details": None, "reasoning_tokens": 0,
                  "completion_tokens_details": None},
        "metadata": {"weight_version": str(version)},
    }  # fmt: skip


def error_response(message: str, status: int = 400) -> web.Response:
    """SGLang's OpenAI ErrorResponse (serving_base.create_error_response)."""
    body = {"object": "error", "message": message, "type": "BadRequest", "param": None, "code": status}
    return web.json_response(body, status=status)


async def chat_completions(request: web.Request) -> web.Response:
    created = int(time.time())
    state = request.app[STATE]
    engine = state.engine
    try:
        if request.content_type != "application/json":
            raise BadRequest("Unsupported Media Type: Only 'application/json' is allowed")
        body = await read_json(request, ENDPOINT, {*CHAT_TYPES, *CHAT_NEUTRAL})
        if body.get("stream"):
            raise BadRequest(f"{ENDPOINT}: stream=true is not supported by mcore-rl-serve")
        req = parse_chat(engine, body)
        async with reading(state, req.sampling.n, ENDPOINT):
            samples = await run_samples(state, [req], req.sampling.n, ENDPOINT)
    except BadRequest as exc:
        return error_response(str(exc))
    return web.json_response(render_chat(samples, body, engine, created))
