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


def _no_load_format(body: dict[str, Any], endpoint: str) -> None:
    if body.get("load_format") is not None:
        raise BadRequest(
            f"{endpoint}: load_format={body['load_format']!r} is not supported by mcore-rl-serve"
        )


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
    group: Any, announced: list[tuple[str, torch.dtype, list[int]]]
) -> list[tuple[str, torch.Tensor]]:
    import torch.distributed as dist

    out = []
    for name, dtype, shape in announced:
        t = torch.empty(shape, dtype=dtype)
        dist.broadcast(t, src=0, group=group)
        out.append((name, t))
    return out


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request, "/update_weights_from_distributed")
    roles = _selector(body, "/update_weights_from_distributed")
    if state.session is None:
        return _reply(False, OUTSIDE_SESSION.format(op="update_weights_from_distributed"))
    _no_load_format(body, "/update_weights_from_distributed")
    name = body.get("group_name") or "weight_update_group"
    if name not in state.groups:
        return _reply(False, f"Failed to receive weights: Group {name} not in {list(state.groups)}. "
                             "Please call `init_weights_update_group` first.")  # fmt: skip
    announced = _announced(body)
    version = _version(state, body)
    async with writer(state, bool(body.get("abort_all_requests"))):
        try:
            tensors = await in_thread(_receive, state.groups[name], announced)
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
        if (module, name) in self.ALLOWED or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"blocked global {module}.{name}")


def open_payload(payload: str) -> list[tuple[str, torch.Tensor]]:
    """One TP rank's base64 ForkingPickler dump -> [(name, tensor)]; ValueError naming what is wrong."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not base64 ({exc})") from None
    try:
        named = _TensorUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # noqa: BLE001 - any malformed pickle is the client's error
        raise ValueError(f"not a tensor payload ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(named, (list, tuple)) or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
        for p in named
    ):
        raise ValueError("the payload must be a list of (name, tensor) pairs")
    return list(named)


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request, "/update_weights_from_tensor")
    roles = _selector(body, "/update_weights_from_tensor")
    if body.get("serialized_named_tensors") is None:
        raise BadRequest("/update_weights_from_tensor: field 'serialized_named_tensors' is required")
    if state.session is None:
        return _reply(False, OUTSIDE_SESSION.format(op="update_weights_from_tensor"))
    _no_load_format(body, "/update_weights_from_tensor")
    payloads = body["serialized_named_tensors"]
    if len(payloads) <= state.tp_rank or not isinstance(payloads[state.tp_rank], str):
        raise BadRequest(f"/update_weights_from_tensor: serialized_named_tensors needs one base64 string per "
                         f"engine TP rank; rank {state.tp_rank} has none ({len(payloads)} given)")  # fmt: skip
    try:
        tensors = await in_thread(open_payload, payloads[state.tp_rank])
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
