"""`mcore-rl-serve`'s in-memory weight updates, as SGLang 0.5.23 serves them (read in its
`scheduler_components/weight_updater.py`, `model_runner_components/weight_updater.py`, `http_server.py`).

Why real transports on CPU: the trainer's tensor and broadcast paths must run end to end in CI, so this stand-in
does what SGLang does, on CPU: `/init_weights_update_group` joins a real (gloo) process group as rank
`rank_offset + tp_rank`; `/update_weights_from_distributed` receives each announced tensor by broadcast from
group rank 0; `/update_weights_from_tensor` opens this rank's ForkingPickler payload (CPU tensors shared by file
name, the `file_system` strategy) with a restricted unpickler. Both load in place into the engine, so later
generations use the new weights. Like SGLang, both refuse to run outside a `/begin_weight_update` ..
`/end_weight_update` session (HTTP 400, its exact messages); disk updates need no session.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import math
import pickle
from typing import Any

import torch
from aiohttp import web

from mcore_rl.distributed import broadcast
from mcore_rl.rollout.server.codec import BadRequest, as_int_version
from mcore_rl.rollout.server.state import STATE, ServerState, in_thread, read_body, writer

log = logging.getLogger("mcore_rl.serve")

SELECTORS = ("target", "draft", "all")
# SGLang's strings (tests/rollout/test_sglang_contract.py compares them with the wheel's source)
OUTSIDE_SESSION = "{op} must run between begin_weight_update() and end_weight_update()"
SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION = "no weight-update session is open; call begin_weight_update() first"
GROUP_INIT_OK = "Succeeded to initialize custom process group."
GROUP_INIT_FAILED = "Failed to initialize custom process group: {err}."
GROUP_DESTROY_OK = "Succeeded to destroy custom process group."
GROUP_MISSING = "The group to be destroyed does not exist."
# torch's own refusal (distributed_c10d._new_process_group_helper) for a name already in use in this process
GROUP_NAME_USED = "The specified group name has already been created, please use a different group name"
GROUP_TIMEOUT_S = 600.0  # rendezvous / broadcast timeout of a joined group (--weight-group-timeout-s)


def _reply(success: bool, message: str) -> web.Response:
    """SGLang's `{success, message}` answer: 200 on success, 400 on failure."""
    if not success:
        log.warning("weight update refused: %s", message)
    return web.json_response({"success": success, "message": message}, status=200 if success else 400)


def _selector(body: dict[str, Any], endpoint: str) -> set[str]:
    """SGLang's runner selector (a Literal field: anything else is a request-validation 400)."""
    selector = body.get("selector") or "all"
    if selector not in SELECTORS:
        raise BadRequest(f"{endpoint}: field 'selector' must be one of {SELECTORS}, got {selector!r}")
    return {"target", "draft"} if selector == "all" else {selector}


def _version(state: ServerState, body: dict[str, Any]) -> int:
    """The version later tokens carry: the request's, else unchanged (a non-final bucket carries none)."""
    version = as_int_version(body.get("weight_version"), "weight_version")
    return state.engine.weight_version if version is None else version


FLAT = "flattened_bucket"  # SGLang's one-buffer-per-bucket format (srt/weight_sync/tensor_bucket.py)


def _load_format(body: dict[str, Any], endpoint: str) -> str | None:
    """None/"direct" (named tensors) or "flattened_bucket"; custom loaders exist only in a real SGLang."""
    fmt = body.get("load_format")
    if fmt not in (None, "direct", FLAT):
        raise BadRequest(
            f"{endpoint}: load_format={fmt!r} is not supported by mcore-rl-serve (none, direct, {FLAT})"
        )
    return FLAT if fmt == FLAT else None


def flat_views(flat: Any, records: list[Any]) -> list[tuple[str, torch.Tensor]]:
    """(name, view) of each record's bytes in one flat uint8 buffer (SGLang's `reconstruct_tensors`), checked."""
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError("flattened_tensor must be a 1-D uint8 tensor")
    out = []
    for m in records:
        name, dtype, shape = getattr(m, "name", None), getattr(m, "dtype", None), getattr(m, "shape", None)
        start, end = getattr(m, "start_idx", None), getattr(m, "end_idx", None)
        if not (
            isinstance(name, str) and isinstance(dtype, torch.dtype) and isinstance(shape, (tuple, list))
        ):
            raise ValueError(f"bad flattened-bucket record {str(getattr(m, '__dict__', m))[:200]}")
        if not all(isinstance(v, int) for v in (start, end, *shape)) or not 0 <= start <= end <= flat.numel():
            raise ValueError(f"{name}: bytes [{start}, {end}) outside the {flat.numel()}-byte bucket")
        if start % dtype.itemsize or end - start != math.prod(shape) * dtype.itemsize:
            raise ValueError(
                f"{name}: bytes [{start}, {end}) do not hold a {dtype} tensor of shape {list(shape)}"
            )
        out.append((name, flat[start:end].view(dtype).reshape(shape)))
    return out


# ---------------------------------------------------------------------- session
async def begin_weight_update(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request, "/begin_weight_update")
    _selector(body, "/begin_weight_update")
    if state.session is not None:
        return _reply(False, SESSION_OPEN)
    state.session = body.get("selector") or "all"
    return _reply(True, "Success")


async def end_weight_update(request: web.Request) -> web.Response:
    state = request.app[STATE]
    await read_body(request, "/end_weight_update")
    if state.session is None:
        return _reply(False, NO_SESSION)
    state.session = None
    return _reply(True, "Success")


# ---------------------------------------------------------------------- groups
def _join(body: dict[str, Any], rank: int, timeout_s: float) -> Any:
    from mcore_rl.rollout.weight_sync.dist_group import init_weight_update_group

    return init_weight_update_group(body["master_address"], body["master_port"], rank, body["world_size"],
                                    body["group_name"], body["backend"], timeout_s=timeout_s)  # fmt: skip


async def init_weights_update_group(request: web.Request) -> web.Response:
    """Join the trainer's group as rank rank_offset + tp_rank (blocks until every rank has joined)."""
    state = request.app[STATE]
    body = await read_body(request, "/init_weights_update_group")
    for key in ("master_address", "master_port", "rank_offset", "world_size"):
        if body.get(key) is None:
            raise BadRequest(f"/init_weights_update_group: field {key!r} is required")
    body = {
        "group_name": "weight_update_group",
        "backend": "nccl",
        **{k: v for k, v in body.items() if v is not None},
    }
    rank = body["rank_offset"] + state.tp_rank
    if not 0 < body["master_port"] < 2**16:
        raise BadRequest(f"/init_weights_update_group: master_port={body['master_port']} is not a TCP port")
    if not 1 <= rank < body["world_size"]:
        raise BadRequest(f"/init_weights_update_group: rank {rank} (rank_offset + tp_rank) must be in "
                         f"[1, world_size={body['world_size']}): rank 0 is the trainer")  # fmt: skip
    if not body["group_name"]:
        raise BadRequest("/init_weights_update_group: group_name must not be empty")
    if body["backend"] != "gloo":  # SGLang would build it; a CPU stand-in cannot, and must not hang trying
        return _reply(False, GROUP_INIT_FAILED.format(
            err=f"backend {body['backend']!r} needs CUDA; mcore-rl-serve runs on CPU, use backend='gloo'"))  # fmt: skip
    if body["group_name"] in state.groups:
        return _reply(False, GROUP_INIT_FAILED.format(err=GROUP_NAME_USED))
    log.info("joining weight-update group %r as rank %d of %d at %s:%d", body["group_name"], rank,
             body["world_size"], body["master_address"], body["master_port"])  # fmt: skip
    try:
        group = await in_thread(_join, body, rank, request.app[GROUP_TIMEOUT])
    except Exception as exc:  # noqa: BLE001 - SGLang answers every failure as a message, so does the stand-in
        return _reply(False, GROUP_INIT_FAILED.format(err=exc))
    state.groups[body["group_name"]] = group
    return _reply(True, GROUP_INIT_OK)


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request, "/destroy_weights_update_group")
    name = body.get("group_name") or "weight_update_group"
    if name not in state.groups:
        return _reply(False, GROUP_MISSING)
    from mcore_rl.rollout.weight_sync.dist_group import destroy_weight_update_group

    try:
        destroy_weight_update_group(state.groups.pop(name))
    except Exception as exc:  # noqa: BLE001
        return _reply(False, f"Failed to destroy custom process group: {exc}.")
    return _reply(True, GROUP_DESTROY_OK)


# ---------------------------------------------------------------------- updates
def _announced(body: dict[str, Any]) -> list[tuple[str, torch.dtype, list[int]]]:
    """(name, dtype, shape) of each tensor rank 0 will broadcast; a 400 before any receive when malformed."""
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if names is None or dtypes is None or shapes is None:
        raise BadRequest("/update_weights_from_distributed: names, dtypes and shapes are required")
    if not len(names) == len(dtypes) == len(shapes):
        raise BadRequest(f"/update_weights_from_distributed: {len(names)} names, {len(dtypes)} dtypes and "
                         f"{len(shapes)} shapes must be as many")  # fmt: skip
    out = []
    for name, dt, shape in zip(names, dtypes, shapes):
        dtype = getattr(torch, dt, None) if dt.isidentifier() else None
        if not isinstance(dtype, torch.dtype):
            raise BadRequest(
                f"/update_weights_from_distributed: dtype {dt!r} of {name!r} is not a torch dtype"
            )
        if any(d < 0 for d in shape) or len(shape) > 8 or math.prod(shape) > 2**31:
            raise BadRequest(
                f"/update_weights_from_distributed: shape {shape} of {name!r} is not a tensor shape"
            )
        out.append((name, dtype, shape))
    return out


def _receive(
    group: Any, announced: list[tuple[str, torch.dtype, list[int]]], fmt: str | None
) -> list[tuple[str, torch.Tensor]]:
    """One broadcast per tensor, or (flattened_bucket) one for the whole bucket, from group rank 0."""
    if fmt == FLAT:
        records, offset = [], 0
        for name, dtype, shape in announced:  # SGLang's FlattenedTensorBucket.empty
            if offset % dtype.itemsize:
                raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
            size = math.prod(shape) * dtype.itemsize
            records.append(
                _Record(name=name, dtype=dtype, shape=tuple(shape), start_idx=offset, end_idx=offset + size)
            )
            offset += size
        if not records:
            raise ValueError("Cannot create empty tensor bucket")
        flat = torch.empty(offset, dtype=torch.uint8)
        broadcast(flat, 0, group)
        return flat_views(flat, records)
    out = []
    for name, dtype, shape in announced:
        t = torch.empty(shape, dtype=dtype)
        broadcast(t, 0, group)
        out.append((name, t))
    return out


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request, "/update_weights_from_distributed")
    roles = _selector(body, "/update_weights_from_distributed")
    if any(body.get(k) is None for k in ("names", "dtypes", "shapes")):  # request validation comes first
        raise BadRequest("/update_weights_from_distributed: names, dtypes and shapes are required")
    if state.session is None:
        return _reply(False, OUTSIDE_SESSION.format(op="update_weights_from_distributed"))
    fmt = _load_format(body, "/update_weights_from_distributed")
    name = body.get("group_name") or "weight_update_group"
    if name not in state.groups:
        return _reply(False, f"Failed to receive weights: Group {name} not in {list(state.groups)}. "
                             "Please call `init_weights_update_group` first.")  # fmt: skip
    announced = _announced(body)
    version = _version(state, body)
    async with writer(state, bool(body.get("abort_all_requests"))):
        try:
            tensors = await in_thread(_receive, state.groups[name], announced, fmt)
        except Exception as exc:  # noqa: BLE001
            return _reply(False, f"Failed to receive weights: {exc}")
        return await _load(state, roles, tensors, version, "Succeeded to update parameter online.")


async def _load(state: ServerState, roles: set[str], tensors, version: int, ok: str) -> web.Response:
    """Load into the target model (the stand-in has no draft model: a draft-only selector loads nothing)."""
    if "target" not in roles:
        return _reply(True, ok)
    try:
        await in_thread(state.engine.update_weights, tensors, version)
    except (KeyError, ValueError, RuntimeError, TypeError) as exc:
        return _reply(False, f"Failed to update parameter online: {exc}. The full weights of the ModelRunner are "
                             "partially updated. Please discard the whole weights.")  # fmt: skip
    return _reply(True, ok)


class _Record:
    """A flattened-bucket metadata record as unpickled here: SGLang's `FlattenedTensorMetadata` or the trainer's
    mirror of it (weight_sync/flat_bucket.py), read by attribute as SGLang does."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


RECORD_CLASSES = {
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
    ("mcore_rl.rollout.weight_sync.flat_bucket", "FlattenedTensorMetadata"),
}


class _TensorUnpickler(pickle.Unpickler):
    """Only what a ForkingPickler dump of [(name, CPU tensor)] needs: torch's rebuild functions, storage, dtypes.
    Why: the payload is pickle from the network; SGLang restricts it the same way (SafeUnpickler)."""

    ALLOWED = {
        ("torch.multiprocessing.reductions", "rebuild_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
        ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_parameter"),
        ("torch.storage", "UntypedStorage"),
        ("torch", "UntypedStorage"),
        ("torch", "Tensor"),
        ("torch", "Size"),
        ("torch.nn.parameter", "Parameter"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in RECORD_CLASSES:
            return _Record
        if (module, name) in self.ALLOWED or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"blocked global {module}.{name}")


def open_payload(payload: str, fmt: str | None = None) -> list[tuple[str, torch.Tensor]]:
    """One TP rank's base64 ForkingPickler dump -> [(name, tensor)]; ValueError naming what is wrong.
    fmt=flattened_bucket: the dump is `{"flattened_tensor": uint8 tensor, "metadata": [records]}`."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not base64 ({exc})") from None
    try:
        obj = _TensorUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # noqa: BLE001 - any malformed pickle is the client's error
        raise ValueError(f"not a tensor payload ({type(exc).__name__}: {str(exc)[:200]})") from None
    if fmt == FLAT:
        if not isinstance(obj, dict) or not isinstance(obj.get("metadata"), list):
            raise ValueError(
                "a flattened_bucket payload is {'flattened_tensor': tensor, 'metadata': [records]}"
            )
        return flat_views(obj.get("flattened_tensor"), obj["metadata"])
    if not isinstance(obj, (list, tuple)) or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
        for p in obj
    ):
        raise ValueError("the payload must be a list of (name, tensor) pairs")
    return list(obj)


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request, "/update_weights_from_tensor")
    roles = _selector(body, "/update_weights_from_tensor")
    if body.get("serialized_named_tensors") is None:
        raise BadRequest("/update_weights_from_tensor: field 'serialized_named_tensors' is required")
    if state.session is None:
        return _reply(False, OUTSIDE_SESSION.format(op="update_weights_from_tensor"))
    fmt = _load_format(body, "/update_weights_from_tensor")
    payloads = body["serialized_named_tensors"]
    if len(payloads) <= state.tp_rank or not isinstance(payloads[state.tp_rank], str):
        raise BadRequest(f"/update_weights_from_tensor: serialized_named_tensors needs one base64 string per "
                         f"engine TP rank; rank {state.tp_rank} has none ({len(payloads)} given)")  # fmt: skip
    try:
        tensors = await in_thread(open_payload, payloads[state.tp_rank], fmt)
    except ValueError as exc:
        raise BadRequest(
            f"/update_weights_from_tensor: serialized_named_tensors[{state.tp_rank}]: {exc}"
        ) from None
    version = _version(state, body)
    async with writer(state, bool(body.get("abort_all_requests"))):
        return await _load(state, roles, tensors, version, "Success")


GROUP_TIMEOUT = web.AppKey("weight_group_timeout_s", float)
ROUTES = {
    "/begin_weight_update": begin_weight_update,
    "/end_weight_update": end_weight_update,
    "/init_weights_update_group": init_weights_update_group,
    "/destroy_weights_update_group": destroy_weights_update_group,
    "/update_weights_from_distributed": update_weights_from_distributed,
    "/update_weights_from_tensor": update_weights_from_tensor,
}


async def close_groups(app: web.Application) -> None:
    """Leave every joined group on shutdown (the trainer may still hold its side)."""
    from mcore_rl.rollout.weight_sync.dist_group import destroy_weight_update_group

    state = app[STATE]
    for name in list(state.groups):
        try:
            destroy_weight_update_group(state.groups.pop(name))
        except Exception as exc:  # noqa: BLE001 - shutting down anyway
            log.warning("weight-update group %r: %s", name, exc)
