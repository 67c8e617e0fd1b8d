"""SGLang's HTTP contract in one place: the allowed field names per endpoint, payload builders, response parsing.

Why a table: SGLang rejects (or worse, silently ignores) unknown fields, and its names drift between releases.
Every payload the client builds is checked against this table before it is sent, `mcore-rl-serve` rejects
anything outside it with HTTP 400, and a test asserts both. Names come from sglang 0.5.x `io_struct.py` /
`sampling_params.py` (see docs/SGLANG_API.md).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from mcore_rl.rollout.protocol import GenerationRequest, Sample, SamplingParams, sample_seed

SAMPLING_FIELDS = frozenset(
    {
        "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos",
        "skip_special_tokens", "no_stop_trim", "n", "min_new_tokens", "frequency_penalty", "presence_penalty",
        "repetition_penalty", "sampling_seed", "json_schema", "regex",
    }
)  # fmt: skip

SGLANG_FIELDS: dict[str, frozenset[str]] = {
    "/generate": frozenset(
        {
            "text",
            "input_ids",
            "sampling_params",
            "return_logprob",
            "logprob_start_len",
            "top_logprobs_num",
            "return_text_in_logprobs",
            "stream",
            "rid",
            "lora_path",
        }
    ),  # fmt: skip
    "/update_weights_from_disk": frozenset(
        {"model_path", "load_format", "abort_all_requests", "weight_version", "flush_cache"}
    ),
    "/update_weights_from_tensor": frozenset(
        {"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests", "weight_version"}
    ),
    "/init_weights_update_group": frozenset(
        {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}
    ),
    "/update_weights_from_distributed": frozenset(
        {
            "names",
            "dtypes",
            "shapes",
            "group_name",
            "flush_cache",
            "abort_all_requests",
            "weight_version",
            "load_format",
        }
    ),  # fmt: skip
    "/destroy_weights_update_group": frozenset({"group_name"}),
    "/update_weight_version": frozenset({"new_version", "abort_all_requests"}),
    "/get_weights_by_name": frozenset({"name", "truncate_size"}),
    "/abort_request": frozenset({"rid", "abort_all"}),
    "/pause_generation": frozenset({"mode"}),
    "/continue_generation": frozenset(),
    "/flush_cache": frozenset(),
    "/release_memory_occupation": frozenset({"tags"}),
    "/resume_memory_occupation": frozenset({"tags"}),
}


def unknown_fields(endpoint: str, payload: dict[str, Any]) -> list[str]:
    """Field names in `payload` that SGLang does not define for `endpoint` (dotted for sampling_params)."""
    if endpoint not in SGLANG_FIELDS:
        raise KeyError(f"endpoint {endpoint} is not in the SGLang field table")
    bad = sorted(set(payload) - SGLANG_FIELDS[endpoint])
    if endpoint == "/generate":
        sps = payload.get("sampling_params") or {}
        for sp in sps if isinstance(sps, list) else [sps]:
            bad += sorted(f"sampling_params.{k}" for k in set(sp) - SAMPLING_FIELDS)
    return bad


def check_payload(endpoint: str, payload: dict[str, Any]) -> None:
    bad = unknown_fields(endpoint, payload)
    if bad:
        raise ValueError(f"{endpoint}: field(s) {bad} are not defined by SGLang")


# ---------------------------------------------------------------- /generate
def sampling_payload(sp: SamplingParams, sample_index: int = 0) -> dict[str, Any]:
    """One sample's sampling_params (n is expanded client-side: SGLang re-assigns rids for n > 1)."""
    out: dict[str, Any] = {
        "max_new_tokens": sp.max_new_tokens,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k,
    }
    if sp.stop:
        out["stop"] = list(sp.stop)
    if sp.stop_token_ids:
        out["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.ignore_eos:
        out["ignore_eos"] = True
    seed = sample_seed(sp.seed, sample_index)
    if seed is not None:
        out["sampling_seed"] = seed
    return out


def generate_payload(items: list[tuple[GenerationRequest, int, str]]) -> dict[str, Any]:
    """A batch /generate body for (request, sample_index, rid) items; always list-of-lists so replies are lists."""
    return {
        "input_ids": [req.prompt_ids for req, _, _ in items],
        "sampling_params": [sampling_payload(req.sampling, j) for req, j, _ in items],
        "rid": [rid for _, _, rid in items],
        "return_logprob": True,
    }


def _as_version(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def token_versions(meta: dict[str, Any], num_tokens: int, default: int) -> list[int]:
    """Per-token versions from SGLang's `weight_versions` spans when present, else its single `weight_version`."""
    spans = meta.get("weight_versions")
    if spans:
        versions = [_as_version(meta.get("weight_version"), default)] * num_tokens
        for span in spans:
            v = _as_version(span.get("version"), default)
            for i in range(max(0, int(span["start"])), min(num_tokens, int(span["end"]))):
                versions[i] = v
        return versions
    return [_as_version(meta.get("weight_version"), default)] * num_tokens


def parse_sample(item: dict[str, Any], req: GenerationRequest, index: int, default_version: int) -> Sample:
    """One /generate result -> Sample; raises if logprobs and ids disagree (that would poison the loss)."""
    meta = item.get("meta_info") or {}
    rid = meta.get("id")
    lps = meta.get("output_token_logprobs") or []
    out_ids = item.get("output_ids")
    out_ids = [int(x[1]) for x in lps] if out_ids is None else [int(t) for t in out_ids]
    if len(lps) != len(out_ids) or any(int(x[1]) != t for x, t in zip(lps, out_ids)):
        raise ValueError(
            f"/generate rid={rid}: output_token_logprobs do not match output_ids ({len(lps)} vs {len(out_ids)})"
        )
    fr = meta.get("finish_reason") or {"type": "abort"}
    kind = fr.get("type", "abort") if isinstance(fr, dict) else str(fr)
    return Sample(
        rid=req.rid,
        prompt_ids=list(req.prompt_ids),
        output_ids=out_ids,
        output_logprobs=[float(x[0]) for x in lps],
        weight_versions=token_versions(meta, len(out_ids), default_version),
        finish_reason=kind if kind in ("stop", "length") else "abort",
        text=item.get("text"),
        matched_stop=fr.get("matched") if isinstance(fr, dict) else None,
        sample_index=index,
        metadata=dict(req.metadata),
    )


# ---------------------------------------------------------------- weight transfer
def bucket_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a tensor stream into buckets of about `bucket_bytes` (a tensor larger than that is its own bucket)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        if bucket and size + t.nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += t.nbytes
    if bucket:
        yield bucket


def serialize_named_tensors(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's MultiprocessingSerializer format: base64 of a ForkingPickler dump (CUDA IPC handles on GPU)."""
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(named_tensors)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def tensor_update_payload(
    serialized_per_rank: list[str], version: int | None, flush_cache: bool = True
) -> dict[str, Any]:
    """/update_weights_from_tensor body: one serialized bucket per engine TP rank."""
    out: dict[str, Any] = {"serialized_named_tensors": serialized_per_rank, "flush_cache": flush_cache}
    if version is not None:
        out["weight_version"] = str(version)
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def distributed_update_payload(
    bucket: list[tuple[str, torch.Tensor]], group_name: str, version: int | None, flush_cache: bool
) -> dict[str, Any]:
    """/update_weights_from_distributed body announcing the tensors rank 0 is about to broadcast."""
    out: dict[str, Any] = {
        "names": [n for n, _ in bucket],
        "dtypes": [dtype_name(t.dtype) for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "group_name": group_name,
        "flush_cache": flush_cache,
    }
    if version is not None:
        out["weight_version"] = str(version)
    return out


def init_group_payload(
    master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
) -> dict[str, Any]:
    return {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": int(rank_offset),
        "world_size": int(world_size),
        "group_name": group_name,
        "backend": backend,
    }
