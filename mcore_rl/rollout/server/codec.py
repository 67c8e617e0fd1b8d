"""SGLang /generate wire format <-> engine objects, for `mcore-rl-serve` (parsing mirrors SGLang's own
normalisation: batch vs single, n expansion order, rid expansion, finish_reason and meta_info shapes)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from mcore_rl.rollout.protocol import GenerationRequest, Sample, SamplingParams

_DIRECT = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "n", "ignore_eos"}
_TEXT_ONLY = {"skip_special_tokens", "no_stop_trim"}
# SGLang fields this engine does not implement: accepted only at their neutral value.
_NEUTRAL = {
    "min_p": 0.0, "min_new_tokens": 0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "json_schema": None, "regex": None,
}  # fmt: skip


class BadRequest(ValueError):
    pass


def as_int_version(value: Any, name: str) -> int | None:
    if value is None:
        return None
    try:
        version = int(value)
    except (TypeError, ValueError):
        raise BadRequest(f"{name}={value!r}: mcore-rl-serve tags tokens with integer versions") from None
    if not 0 <= version < 2**63:
        raise BadRequest(f"{name}={value!r}: must be in [0, 2**63)")
    return version


def _per_item(value: Any, n: int, name: str, default: Any) -> list[Any]:
    if value is None:
        return [default] * n
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"{name} has {len(value)} entries for a batch of {n}")
        return value
    return [value] * n


def _sampling(sp: dict[str, Any], where: str) -> SamplingParams:
    for key, neutral in _NEUTRAL.items():
        if sp.get(key, neutral) not in (neutral, None):
            raise BadRequest(f"{where}.{key}={sp[key]!r} is not supported by mcore-rl-serve")
    kw = {k: v for k, v in sp.items() if k in _DIRECT}
    if sp.get("sampling_seed") is not None:
        kw["seed"] = int(sp["sampling_seed"])
    try:
        return SamplingParams(**kw)
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"{where}: {exc}") from None


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """What this engine cannot do is a 400 naming the field, never silently ignored."""
    if (body.get("text") is None) == (body.get("input_ids") is None):
        raise BadRequest("/generate: give exactly one of text or input_ids")
    for key, ok in (
        ("logprob_start_len", (None, -1)),
        ("top_logprobs_num", (None, 0)),
        ("lora_path", (None,)),
    ):
        if any(v not in ok for v in (body.get(key) if isinstance(body.get(key), list) else [body.get(key)])):
            raise BadRequest(f"/generate: {key}={body.get(key)!r} is not supported by mcore-rl-serve")
    if body.get("stream"):
        raise BadRequest("/generate: stream=true is not supported by mcore-rl-serve")


def _prompts(body: dict[str, Any], tokenizer, vocab_size: int | None) -> tuple[list[list[int]], bool]:
    """(prompt token ids, single): text is tokenized; ids must be in the vocabulary."""
    if body.get("text") is not None:
        if tokenizer is None:
            raise BadRequest("/generate: text input needs a tokenizer; this model folder has none")
        texts = [body["text"]] if isinstance(body["text"], str) else list(body["text"])
        prompts = [tokenizer(t)["input_ids"] for t in texts]
        single = isinstance(body["text"], str)
    else:
        ids = body["input_ids"]
        single = bool(ids) and isinstance(ids[0], int)
        prompts = [ids] if single else list(ids)
    if not prompts or any(not isinstance(p, list) or not p for p in prompts):
        raise BadRequest("/generate: input_ids must be a non-empty list of ints or of non-empty lists")
    if vocab_size is not None:
        for i, p in enumerate(prompts):
            if any(not 0 <= t < vocab_size for t in p):
                raise BadRequest(f"/generate: input_ids[{i}] has token ids out of range [0, {vocab_size})")
    return prompts, single


def parse_generate(
    body: dict[str, Any], tokenizer, context_len: int | None = None, vocab_size: int | None = None
) -> tuple[list[GenerationRequest], list[dict], bool]:
    """SGLang /generate body (types already checked) -> (requests, per-item options, single).

    Mirrors SGLang's normalisation; like SGLang, a prompt + max_new_tokens beyond the context length is a 400.
    """
    _refuse_unsupported(body)
    prompts, single = _prompts(body, tokenizer, vocab_size)
    n = len(prompts)
    sps = _per_item(body.get("sampling_params"), n, "sampling_params", {})
    rids = body.get("rid")
    if isinstance(rids, str):
        rids = [rids] if single else [f"{rids}_{i}" for i in range(n)]
    rids = _per_item(rids, n, "rid", None)
    logprob = _per_item(body.get("return_logprob"), n, "return_logprob", False)
    requests, options = [], []
    for i, (prompt, sp) in enumerate(zip(prompts, sps)):
        where = "sampling_params" if single else f"sampling_params[{i}]"
        params = _sampling(sp or {}, where)
        if vocab_size is not None and params.top_k > vocab_size:  # the same distribution; fits an int64 tensor
            params.top_k = vocab_size
        try:
            requests.append(GenerationRequest(prompt, params, rid=rids[i] or uuid.uuid4().hex))
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"/generate item {i}: {exc}") from None
        total = len(prompt) + params.max_new_tokens
        if context_len is not None and total > context_len:
            raise BadRequest(
                f"/generate item {i}: prompt ({len(prompt)} tokens) + {where}.max_new_tokens "
                f"({params.max_new_tokens}) = {total} exceeds the context length {context_len}"
            )
        options.append(
            {
                "return_logprob": bool(logprob[i]),
                "text_in_logprobs": bool(body.get("return_text_in_logprobs")),
                **{k: sp.get(k) for k in _TEXT_ONLY},
            }
        )
    if len({r.sampling.n for r in requests}) > 1:
        raise BadRequest("/generate: sampling_params.n must be the same for every item (as in SGLang)")
    return requests, options, single and requests[0].sampling.n == 1


# SGLang's aborts: a request still queued is answered by its tokenizer manager's _handle_abort_req ("Abort in
# waiting queue", no output); a running one finishes with FINISH_ABORT(message=None).to_json() and keeps the tokens
# it had produced (with their log-probs).
ABORT_QUEUED = {"type": "abort", "message": "Abort in waiting queue"}
ABORT_RUNNING = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def _finish(sample: Sample) -> dict[str, Any]:
    if sample.finish_reason == "stop":
        return {"type": "stop", "matched": sample.matched_stop}
    if sample.finish_reason == "length":
        return {"type": "length", "length": len(sample.output_ids)}
    return dict(ABORT_RUNNING if sample.output_ids else ABORT_QUEUED)


def _spans(versions: list[int]) -> list[dict[str, Any]]:
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans


def render_sample(sample: Sample, opts: dict, engine, t0: float) -> dict[str, Any]:
    if sample.finish_reason == "abort" and not sample.output_ids:  # SGLang's _handle_abort_req reply, as is
        v = str(engine.weight_version)
        meta = {"id": sample.rid, "finish_reason": dict(ABORT_QUEUED), "weight_version": v,
                "e2e_latency": time.perf_counter() - t0,
                "weight_versions": [{"version": v, "start": 0, "end": 0}]}  # fmt: skip
        if opts["return_logprob"]:  # its add_logprob_to_meta_info over no tokens
            meta.update(input_token_logprobs=[], output_token_logprobs=[], output_token_logprobs_length=0)
        meta["completion_tokens"] = 0
        return {"text": "", "output_ids": [], "meta_info": meta}
    tok = engine.tokenizer
    text = sample.text
    if tok is not None and (opts.get("skip_special_tokens") is False or opts.get("no_stop_trim")):
        text = tok.decode(sample.output_ids, skip_special_tokens=opts.get("skip_special_tokens") is not False)
    meta: dict[str, Any] = {
        "id": sample.rid,
        "finish_reason": _finish(sample),
        "prompt_tokens": len(sample.prompt_ids),
        "completion_tokens": len(sample.output_ids),
        "cached_tokens": 0,
        "weight_version": str(
            sample.weight_versions[-1] if sample.weight_versions else engine.weight_version
        ),
        "weight_versions": _spans(sample.weight_versions),
        "e2e_latency": time.perf_counter() - t0,
    }
    if opts["return_logprob"]:
        piece = (
            (lambda t: tok.decode([t]))
            if (opts["text_in_logprobs"] and tok is not None)
            else (lambda t: None)
        )
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [
            [lp, t, piece(t)] for lp, t in zip(sample.output_logprobs, sample.output_ids)
        ]
    return {"text": text if text is not None else "", "output_ids": sample.output_ids, "meta_info": meta}
