"""SGLang's HTTP contract in one place: the allowed field names per endpoint, payload builders, response parsing.

Why a table: SGLang rejects (or worse, silently ignores) unknown fields, and its names drift between releases.
Every payload the client builds is checked against this table before it is sent; `mcore-rl-serve` validates
types with it and, like SGLang, ignores unknown top-level fields (sglang-router adds some) but answers 400 to
unknown `sampling_params` keys. Tests assert both sides. Names come from sglang 0.5.x `io_struct.py` /
`sampling_params.py` (see docs/SGLANG_API.md).
"""

from __future__ import annotations

import base64
import importlib
import io
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mcore_rl.rollout.protocol import GenerationRequest, Sample, SamplingParams, sample_seed

# Field -> accepted JSON kinds (null is always accepted: every SGLang field is Optional). The server validates
# types with this table (a 400 naming the field instead of a 500), the client checks its payloads against the
# names. Kinds: int (not bool), number, bool, str, dict, list (any), list[int], list[str], list[dict], list[bool],
# list[list[int]].
SAMPLING_TYPES: dict[str, tuple[str, ...]] = {
    "max_new_tokens": ("int",), "temperature": ("number",), "top_p": ("number",), "top_k": ("int",),
    "min_p": ("number",), "stop": ("str", "list[str]"), "stop_token_ids": ("list[int]",), "ignore_eos": ("bool",),
    "skip_special_tokens": ("bool",), "no_stop_trim": ("bool",), "n": ("int",), "min_new_tokens": ("int",),
    "frequency_penalty": ("number",), "presence_penalty": ("number",), "repetition_penalty": ("number",),
    "sampling_seed": ("int",), "json_schema": ("str",), "regex": ("str",),
}  # fmt: skip
_VERSION = ("str", "int")
SGLANG_TYPES: dict[str, dict[str, tuple[str, ...]]] = {
    "/generate": {
        "text": ("str", "list[str]"), "input_ids": ("list[int]", "list[list[int]]"),
        "sampling_params": ("dict", "list[dict]"), "return_logprob": ("bool", "list[bool]"),
        "logprob_start_len": ("int", "list[int]"), "top_logprobs_num": ("int", "list[int]"),
        "return_text_in_logprobs": ("bool",), "stream": ("bool",), "rid": ("str", "list[str]"),
        "lora_path": ("str", "list[str]"),
    },
    "/update_weights_from_disk": {
        "model_path": ("str",), "load_format": ("str",), "abort_all_requests": ("bool",),
        "weight_version": _VERSION, "flush_cache": ("bool",),
    },
    "/update_weights_from_tensor": {
        "serialized_named_tensors": ("list",), "load_format": ("str",), "flush_cache": ("bool",),
        "abort_all_requests": ("bool",), "weight_version": _VERSION, "selector": ("str",),
    },
    "/init_weights_update_group": {
        "master_address": ("str",), "master_port": ("int",), "rank_offset": ("int",), "world_size": ("int",),
        "group_name": ("str",), "backend": ("str",),
    },
    "/update_weights_from_distributed": {
        "names": ("list[str]",), "dtypes": ("list[str]",), "shapes": ("list[list[int]]",), "group_name": ("str",),
        "flush_cache": ("bool",), "abort_all_requests": ("bool",), "weight_version": _VERSION,
        "load_format": ("str",), "selector": ("str",),
    },
    "/destroy_weights_update_group": {"group_name": ("str",)},
    # 0.5.23: tensor/distributed updates only between these two (BeginWeightUpdateReqInput, EndWeightUpdateReqInput)
    "/begin_weight_update": {"selector": ("str",)},
    "/end_weight_update": {},
    "/update_weight_version": {"new_version": _VERSION, "abort_all_requests": ("bool",)},
    "/get_weights_by_name": {"name": ("str",), "truncate_size": ("int",)},
    "/abort_request": {"rid": ("str",), "abort_all": ("bool",)},
    "/pause_generation": {"mode": ("str",)},
    "/continue_generation": {},
    "/flush_cache": {},
    "/release_memory_occupation": {"tags": ("list[str]",)},
    "/resume_memory_occupation": {"tags": ("list[str]",)},
}  # fmt: skip
SAMPLING_FIELDS = frozenset(SAMPLING_TYPES)
SGLANG_FIELDS: dict[str, frozenset[str]] = {ep: frozenset(fields) for ep, fields in SGLANG_TYPES.items()}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_KIND: dict[str, Any] = {
    "int": _is_int,
    "number": lambda v: _is_int(v) or isinstance(v, float),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "dict": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
}
for _k in ("int", "str", "dict", "bool"):
    _KIND[f"list[{_k}]"] = lambda v, f=_KIND[_k]: isinstance(v, list) and all(map(f, v))
_KIND["list[list[int]]"] = lambda v: isinstance(v, list) and all(map(_KIND["list[int]"], v))


def type_error(endpoint: str, payload: dict[str, Any]) -> str | None:
    """The first field of `payload` whose JSON type SGLang would refuse, as one line; None when all fit.

    Unknown top-level fields are not errors (SGLang ignores them; sglang-router adds some); unknown
    sampling_params keys are (SGLang answers 400).
    """
    table = SGLANG_TYPES[endpoint]
    for name, value in payload.items():
        kinds = table.get(name)
        if kinds is not None and value is not None and not any(_KIND[k](value) for k in kinds):
            return f"{endpoint}: field {name!r} must be {' or '.join(kinds)}, got {type(value).__name__}"
    if endpoint == "/generate":
        sps = payload.get("sampling_params") or {}
        for i, sp in enumerate(sps if isinstance(sps, list) else [sps]):
            where = f"sampling_params[{i}]" if isinstance(sps, list) else "sampling_params"
            for key, value in sp.items():
                if key not in SAMPLING_TYPES:
                    return f"{endpoint}: unknown key {where}.{key} (SGLang rejects it)"
                kinds = SAMPLING_TYPES[key]
                if value is not None and not any(_KIND[k](value) for k in kinds):
                    return f"{endpoint}: field {where}.{key} must be {' or '.join(kinds)}, got {type(value).__name__}"
    return None


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
    """The client's guard: every payload it builds stays a subset of SGLang's fields."""
    bad = unknown_fields(endpoint, payload)
    if bad:
        raise ValueError(f"{endpoint}: field(s) {bad} are not defined by SGLang")


# ---------------------------------------------------------------- /generate
def sampling_payload(sp: SamplingParams, sample_index: int = 0, seeded: bool = True) -> dict[str, Any]:
    """One sample's sampling_params (n is expanded client-side: SGLang re-assigns rids for n > 1).

    seeded: send `sampling_seed` (SGLang honours it only with --enable-deterministic-inference).
    """
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
    if seed is not None and seeded:
        out["sampling_seed"] = seed
    return out


def generate_payload(items: list[tuple[GenerationRequest, int, str]], seeded: bool = True) -> dict[str, Any]:
    """A batch /generate body for (request, sample_index, rid) items; always list-of-lists so replies are lists.

    For worker URLs only: sglang-router's request type takes one prompt per request (a list -> 422).
    """
    return {
        "input_ids": [req.prompt_ids for req, _, _ in items],
        "sampling_params": [sampling_payload(req.sampling, j, seeded) for req, j, _ in items],
        "rid": [rid for _, _, rid in items],
        "return_logprob": True,
    }


def single_generate_payload(item: tuple[GenerationRequest, int, str], seeded: bool = True) -> dict[str, Any]:
    """One sample's /generate body (what sglang-router accepts): scalar rid, one sampling_params object."""
    req, j, rid = item
    return {
        "input_ids": req.prompt_ids,
        "sampling_params": sampling_payload(req.sampling, j, seeded),
        "rid": rid,
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
@contextmanager
def _cpu_shared_by_name() -> Iterator[None]:
    """CPU tensors pickle as shared-memory FILE NAMES (torch's `file_system` strategy) for the dump's duration.

    Why: the default `file_descriptor` strategy passes descriptors through this process's resource sharer, which
    only a child process (same authkey) can reach; a server started on its own opens a file name. CUDA
    tensors are unaffected (IPC handles either way).
    """
    import torch.multiprocessing as tmp

    old = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        tmp.set_sharing_strategy(old)


def serialize_named_tensors(named_tensors: Any) -> str:
    """SGLang's MultiprocessingSerializer format: base64 of a ForkingPickler dump (CUDA IPC handles on GPU, shared
    memory file names on CPU) of [(name, tensor)] or a flattened bucket {flattened_tensor, metadata}. The tensors
    must stay alive until the receiver has loaded them."""
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    with _cpu_shared_by_name():
        ForkingPickler(buf).dump(named_tensors)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def patch_torch_reductions() -> bool:
    """Apply SGLang's torch-reductions patch when sglang is importable (CUDA IPC handles then name the device by
    GPU UUID, so a server process with another CUDA_VISIBLE_DEVICES order maps them right). True if applied."""
    for mod in ("sglang.srt.utils.patch_torch", "sglang.srt.patch_torch"):
        try:
            patch = importlib.import_module(mod).monkey_patch_torch_reductions
        except (ImportError, AttributeError):
            continue
        patch()
        return True
    return False


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
