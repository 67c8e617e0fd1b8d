"""SGLang 0.5.23's HTTP contract read from the real wheel's source (no install: its modules need CUDA-era deps),
and `mcore-rl-serve`'s weight-update sessions and transports checked against it.

The wheel comes from `pip download --no-deps sglang==0.5.23` into ~/.cache/mcore-rl (reused). From it, by AST:
the route table of `srt/entrypoints/http_server.py`, the request structs of `srt/managers/io_struct.py` (and the
sampling parameters), the refusal strings of both `weight_updater.py`s. The second half runs a real stand-in
server process and a trainer (this process) through begin -> update (gloo broadcast / shared-memory tensors)
-> end, and checks what SGLang would refuse is refused with SGLang's words.
"""

from __future__ import annotations

import ast
import asyncio
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mcore_rl.rollout.sglang.api import SAMPLING_TYPES, SGLANG_TYPES

pytestmark = pytest.mark.rollout
VERSION = "0.5.23"
CACHE = Path.home() / ".cache" / "mcore-rl" / f"sglang-{VERSION}"
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
SAMPLING = "sglang/srt/sampling/sampling_params.py"
SCHED_UPDATER = "sglang/srt/managers/scheduler_components/weight_updater.py"
RUNNER_UPDATER = "sglang/srt/model_executor/model_runner_components/weight_updater.py"


@pytest.fixture(scope="session")
def wheel() -> zipfile.ZipFile:
    found = sorted(CACHE.glob(f"sglang-{VERSION}-*.whl"))
    if not found:
        CACHE.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            f"sglang=={VERSION}",
            "-d",
            str(CACHE),
            "-q",
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            pytest.skip(f"sglang=={VERSION} wheel not downloadable: {exc}")
        found = sorted(CACHE.glob(f"sglang-{VERSION}-*.whl"))
        if proc.returncode != 0 or not found:
            pytest.skip(
                f"sglang=={VERSION} wheel not downloadable: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"
            )
    return zipfile.ZipFile(found[-1])


def _tree(wheel: zipfile.ZipFile, path: str) -> ast.Module:
    return ast.parse(wheel.read(path).decode())


def _name(node: ast.AST | None) -> str | None:
    """`X` of an `obj: X` or `obj: Annotated[X, Body()]` parameter."""
    if isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "Annotated":
        node = node.slice.elts[0] if isinstance(node.slice, ast.Tuple) else node.slice
    return node.id if isinstance(node, ast.Name) else None


def routes(tree: ast.Module) -> dict[str, tuple[set[str], str | None]]:
    """path -> (HTTP methods, request struct of the handler's first parameter) from `@app.get/post/api_route`."""
    out: dict[str, tuple[set[str], str | None]] = {}
    for fn in tree.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)):
                continue
            if getattr(dec.func.value, "id", None) != "app" or not dec.args:
                continue
            if not isinstance(dec.args[0], ast.Constant):
                continue
            kind = dec.func.attr
            if kind == "api_route":
                kw = {k.arg: k.value for k in dec.keywords}
                methods = {e.value for e in kw["methods"].elts} if "methods" in kw else {"GET"}
            elif kind in ("get", "post", "put", "delete"):
                methods = {kind.upper()}
            else:
                continue
            body = _name(fn.args.args[0].annotation) if fn.args.args else None
            old = out.get(dec.args[0].value, (set(), None))
            out[dec.args[0].value] = (old[0] | methods, body or old[1])
    return out


def struct_fields(tree: ast.Module) -> dict[str, set[str]]:
    """Class -> annotated field names, with those of its bases defined in the same file."""
    classes = {c.name: c for c in tree.body if isinstance(c, ast.ClassDef)}

    def fields(name: str) -> set[str]:
        cls = classes[name]
        own = {
            s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
        }
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                own |= fields(base.id)
        return own

    return {name: fields(name) for name in classes}


def strings(tree: ast.Module) -> set[str]:
    """Every string constant, and every f-string with `{}` for its fields."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.add(node.value)
        elif isinstance(node, ast.JoinedStr):
            out.add("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values))
    return out


# ---------------------------------------------------------------------- the contract, from the source
def test_our_endpoints_and_fields_exist_in_sglang(wheel):
    table = routes(_tree(wheel, HTTP_SERVER))
    structs = struct_fields(_tree(wheel, IO_STRUCT))
    assert len(table) > 50 and "/generate" in table  # the parser really read the route table
    for endpoint, fields in SGLANG_TYPES.items():
        assert endpoint in table, f"{endpoint} is not a route of sglang {VERSION}"
        methods, struct = table[endpoint]
        assert "POST" in methods, (endpoint, methods)  # the client POSTs every body it sends
        if fields:
            assert struct in structs, (endpoint, struct)
            missing = set(fields) - structs[struct]
            assert not missing, f"{endpoint}: {sorted(missing)} not fields of sglang's {struct}"
    # sampling_params keys: fields of its SamplingParams struct
    assert set(SAMPLING_TYPES) <= struct_fields(_tree(wheel, SAMPLING))["SamplingParams"]


def test_session_routes_and_stand_in_routes_match_sglang(wheel, tmp_path):
    from mcore_rl.rollout.server.app import build_app

    table = routes(_tree(wheel, HTTP_SERVER))
    structs = struct_fields(_tree(wheel, IO_STRUCT))
    for path in ("/begin_weight_update", "/end_weight_update"):
        assert "POST" in table[path][0]
    assert structs[table["/begin_weight_update"][1]] >= {"selector"}
    assert set(SGLANG_TYPES["/end_weight_update"]) <= structs[table["/end_weight_update"][1]]
    # /server_info = the flat ServerArgs struct (built from namespaces, Parallel among them): `tp_size` top-level
    assert "tp_size" in struct_fields(_tree(wheel, "sglang/srt/arg_groups/fields/parallel.py"))["Parallel"]
    args_src = wheel.read("sglang/srt/server_args.py").decode()
    assert "collect_input_fields(_INPUT_NAMESPACES)" in args_src and "    Parallel,\n" in args_src
    app = build_app(None, {"model_path": str(tmp_path)}, close_engine=False)  # routes only; no engine needed
    served = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    assert len(served) > 20
    for method, path in sorted(served):
        assert path in table, f"mcore-rl-serve serves {path}, which sglang {VERSION} does not have"
        assert method in table[path][0], (method, path, table[path][0])


def test_stand_in_refusals_are_sglangs_strings(wheel):
    import inspect

    from torch.distributed import distributed_c10d

    from mcore_rl.rollout.server import weight_update as wu

    sched, runner = strings(_tree(wheel, SCHED_UPDATER)), strings(_tree(wheel, RUNNER_UPDATER))
    for op in ("update_weights_from_tensor", "update_weights_from_distributed"):
        assert wu.OUTSIDE_SESSION.format(op=op) in sched
    assert {wu.SESSION_OPEN, wu.NO_SESSION} <= sched
    assert {wu.GROUP_INIT_OK, wu.GROUP_DESTROY_OK, wu.GROUP_MISSING} <= runner
    assert wu.GROUP_INIT_FAILED.replace("{err}", "{}") in runner
    assert "invalid selector {}; expected 'target', 'draft', or 'all'" in sched and wu.SELECTORS == (
        "target", "draft", "all")  # fmt: skip
    # a live group name: torch's own refusal, which SGLang's init answer wraps
    c10d_src = ast.parse(inspect.getsource(distributed_c10d))
    assert wu.GROUP_NAME_USED in strings(c10d_src)


def test_io_struct_does_not_import_here(wheel):
    """Why AST: the real module needs sglang's runtime (pybase64, zmq, CUDA-era internals) to import."""
    sys.path.insert(0, wheel.filename)
    try:
        with pytest.raises(ImportError):
            __import__("sglang.srt.managers.io_struct")
    finally:
        sys.path.remove(wheel.filename)
        for mod in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
            del sys.modules[mod]


# ---------------------------------------------------------------------- the stand-in, through real transports
@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    from mcore_rl.rollout.sglang.launcher import LauncherConfig, ServerLauncher

    cfg = LauncherConfig(
        model_path=str(tiny_dir), server="mcore-rl-serve", log_dir=str(tmp_path_factory.mktemp("contract_logs")),
        extra_args=["--num-threads", "1", "--weight-group-timeout-s", "60"], health_timeout_s=120, monitor=False,
    )  # fmt: skip
    with ServerLauncher(cfg) as launcher:
        yield launcher.worker_urls[0]


def run(coro):
    return asyncio.run(coro)


def _state(model) -> list:
    return [(n, t.detach().clone()) for n, t in model.state_dict().items()]


def _logprobs(client, prompt: list[int]) -> tuple[list[int], list[float]]:
    from mcore_rl.rollout.protocol import GenerationRequest, SamplingParams

    async def one():
        req = GenerationRequest(
            prompt, SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=3)
        )
        (s,) = await client.generate([req])
        return s.output_ids, s.output_logprobs

    return one()


def test_distributed_update_over_gloo_then_tensor_update_change_generation(
    server, tiny_model, tiny_alt_model
):
    """begin -> init group -> broadcast every tensor of another model -> end: the server then generates with
    exactly that model's log-probs. Then the same back to the first model through shared-memory tensors."""
    import json
    import urllib.request

    import torch

    from mcore_rl.config.checks import ConfigError
    from mcore_rl.rollout.server import weight_update as wu
    from mcore_rl.rollout.sglang.client import AsyncSGLangClient, SGLangClientConfig, SGLangHTTPError
    from mcore_rl.rollout.sglang.launcher import free_port
    from mcore_rl.rollout.weight_sync.dist_group import destroy_weight_update_group, init_weight_update_group
    from tests.rollout.conftest import forward_logprobs
    from tests.rollout.sglang_payloads import (
        distributed_update_payload,
        serialize_per_rank,
        tensor_update_payload,
    )

    prompt = [5, 9, 17, 33]
    name = "model.layers.1.mlp.down_proj.weight"

    def read(param: str) -> list[float]:
        body = json.dumps({"name": param, "truncate_size": 10**6}).encode()
        req = urllib.request.Request(server + "/get_weights_by_name", data=body, method="POST")
        return json.loads(urllib.request.urlopen(req, timeout=30).read())

    async def join(client, port: int):
        fut = asyncio.ensure_future(client.init_weights_update_group("127.0.0.1", port, [1], "g", "gloo"))
        group = await asyncio.to_thread(init_weight_update_group, "127.0.0.1", port, 0, 2, "g", "gloo", 60)
        await fut
        return group

    async def scenario():
        client = AsyncSGLangClient(SGLangClientConfig([server]))
        try:
            assert await client.sessions.resolve_tp_size(None) == 1  # from GET /server_info
            with pytest.raises(ConfigError, match=rf"rollout.tp_size=2 but worker {server} runs tp_size=1"):
                await client.sessions.resolve_tp_size(2)
            with pytest.raises(ConfigError, match="rollout.tp_size=2"):  # before any join: no rendezvous hang
                await client.init_weights_update_group("127.0.0.1", free_port(), [2], "g", "gloo")
            ids0, lp0 = await _logprobs(client, prompt)
            group = await join(client, port := free_port())
            # a live group name: SGLang's refusal (torch's message inside); the trainer's own side is untouched
            body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                    "group_name": "g", "backend": "gloo"}  # fmt: skip
            with pytest.raises(SGLangHTTPError, match=wu.GROUP_NAME_USED):
                await client.request("POST", server, "/init_weights_update_group", body)
            new = _state(tiny_alt_model)
            await client.begin_update()
            try:
                payload = distributed_update_payload(new, "g", 7, flush_cache=True)
                fut = asyncio.ensure_future(client.update_weights_from_distributed(payload))
                await asyncio.to_thread(
                    lambda: [torch.distributed.broadcast(t, src=0, group=group) for _, t in new]
                )
                await fut
            finally:
                await client.end_update()
            after = (await asyncio.to_thread(read, name), dict(new)[name].flatten().tolist())
            ids1, lp1 = await _logprobs(client, prompt)
            # restarted trainer: same group name again; the client destroys the server's group first
            destroy_weight_update_group(group)
            group = await join(client, free_port())
            destroy_weight_update_group(group)
            # back to the first model through shared-memory tensors (the colocated path, on CPU)
            old = _state(tiny_model)
            await client.begin_update()
            try:
                payloads, alive = serialize_per_rank(old, [torch.device("cpu")])
                await client.update_weights_from_tensor(server, tensor_update_payload(payloads, 8))
            finally:
                await client.end_update()
            del alive
            ids2, lp2 = await _logprobs(client, prompt)
            return (ids0, lp0), (ids1, lp1), (ids2, lp2), after, client.weight_version
        finally:
            await client.close()

    (ids0, lp0), (ids1, lp1), (ids2, lp2), after, _ = run(scenario())
    assert after[0] == after[1]  # the broadcast values, bit for bit
    for ids, lp, model in ((ids0, lp0, tiny_model), (ids1, lp1, tiny_alt_model), (ids2, lp2, tiny_model)):
        want = forward_logprobs(model, prompt, ids, 1.0)
        assert torch.allclose(torch.tensor(lp), want, atol=1e-4), (lp, want.tolist())
    other = forward_logprobs(tiny_model, prompt, ids1, 1.0)
    assert (torch.tensor(lp1) - other).abs().max() > 0.1  # the update really changed the model
    assert ids2 == ids0 and lp2 == pytest.approx(lp0, abs=1e-5)
    info = json.loads(urllib.request.urlopen(server + "/model_info", timeout=30).read())
    assert info["weight_version"] == "8"


def test_failed_update_still_closes_the_session(server):
    """An update refused midway: the caller sees that error, and the session is closed (a new one opens)."""
    import torch

    from mcore_rl.rollout.sglang.client import AsyncSGLangClient, SGLangClientConfig, SGLangHTTPError
    from tests.rollout.sglang_payloads import serialize_per_rank, tensor_update_payload

    async def scenario():
        client = AsyncSGLangClient(SGLangClientConfig([server]))
        try:
            await client.begin_update()
            with pytest.raises(SGLangHTTPError, match="unknown tensor name 'model.nope'"):
                try:
                    payloads, _alive = serialize_per_rank(
                        [("model.nope", torch.ones(3))], [torch.device("cpu")]
                    )
                    await client.update_weights_from_tensor(server, tensor_update_payload(payloads, 9))
                finally:
                    await client.end_update()
            assert client.sessions.open == []
            await client.begin_update()  # would answer "already open" had end_update not closed it
            await client.end_update()
        finally:
            await client.close()

    run(scenario())


def test_flattened_bucket_over_both_transports(server, tiny_model, monkeypatch):
    """SGLang's load_format=flattened_bucket: one uint8 buffer per bucket + metadata records (pickled under SGLang's
    own module path, as a trainer with sglang importable sends them); one broadcast per bucket on the group path."""
    import dataclasses
    import json
    import types
    import urllib.request

    import torch

    from mcore_rl.rollout.sglang.api import serialize_named_tensors
    from mcore_rl.rollout.sglang.client import AsyncSGLangClient, SGLangClientConfig
    from mcore_rl.rollout.sglang.launcher import free_port
    from mcore_rl.rollout.weight_sync.dist_group import destroy_weight_update_group, init_weight_update_group

    @dataclasses.dataclass
    class FlattenedTensorMetadata:  # field for field sglang.srt.weight_sync.tensor_bucket's
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    mod = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")
    FlattenedTensorMetadata.__module__, FlattenedTensorMetadata.__qualname__ = (
        mod.__name__,
        "FlattenedTensorMetadata",
    )
    mod.FlattenedTensorMetadata = FlattenedTensorMetadata
    for parent in ("sglang", "sglang.srt", "sglang.srt.weight_sync"):  # what pickle imports to find the class
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, mod.__name__, mod)

    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"]
    sd = tiny_model.state_dict()

    def bucket(scale: float) -> tuple[torch.Tensor, list]:
        tensors = [sd[n] * scale for n in names]
        flat = torch.cat([t.flatten().view(torch.uint8) for t in tensors])
        meta, off = [], 0
        for n, t in zip(names, tensors):
            meta.append(FlattenedTensorMetadata(n, t.shape, t.dtype, off, off + t.nbytes, t.nbytes))
            off += t.nbytes
        return flat, meta

    def read(param: str) -> torch.Tensor:
        body = json.dumps({"name": param, "truncate_size": 10**6}).encode()
        req = urllib.request.Request(server + "/get_weights_by_name", data=body, method="POST")
        return torch.tensor(json.loads(urllib.request.urlopen(req, timeout=30).read()))

    async def scenario():
        client = AsyncSGLangClient(SGLangClientConfig([server]))
        seen = []
        try:
            flat, meta = bucket(2.0)  # shared-memory tensor path
            body = {"serialized_named_tensors": [serialize_named_tensors({"flattened_tensor": flat, "metadata": meta})],
                    "load_format": "flattened_bucket", "weight_version": "11"}  # fmt: skip
            await client.begin_update()
            try:
                await client.update_weights_from_tensor(server, body)
            finally:
                await client.end_update()
            seen.append([await asyncio.to_thread(read, n) for n in names])
            port = free_port()  # group path: one broadcast of the whole bucket
            fut = asyncio.ensure_future(
                client.init_weights_update_group("127.0.0.1", port, [1], "gflat", "gloo")
            )
            group = await asyncio.to_thread(
                init_weight_update_group, "127.0.0.1", port, 0, 2, "gflat", "gloo", 60
            )
            await fut
            flat, _ = bucket(-1.0)
            body = {"names": names, "dtypes": ["float32"] * 2, "shapes": [list(sd[n].shape) for n in names],
                    "group_name": "gflat", "load_format": "flattened_bucket"}  # fmt: skip
            await client.begin_update()
            try:
                fut = asyncio.ensure_future(client.update_weights_from_distributed(body))
                await asyncio.to_thread(torch.distributed.broadcast, flat, 0, group)
                await fut
            finally:
                await client.end_update()
            seen.append([await asyncio.to_thread(read, n) for n in names])
            destroy_weight_update_group(group)
            await client.request("POST", server, "/destroy_weights_update_group", {"group_name": "gflat"})
            flat, meta = bucket(1.0)  # back to the original values
            body["serialized_named_tensors"] = [
                serialize_named_tensors({"flattened_tensor": flat, "metadata": meta})
            ]
            await client.begin_update()
            try:
                await client.update_weights_from_tensor(server, {k: body[k] for k in ("serialized_named_tensors",
                                                                                       "load_format")})  # fmt: skip
            finally:
                await client.end_update()
            seen.append([await asyncio.to_thread(read, n) for n in names])
            return seen
        finally:
            await client.close()

    for got, scale in zip(run(scenario()), (2.0, -1.0, 1.0)):
        for n, t in zip(names, got):
            assert torch.equal(t, (sd[n] * scale).flatten()), (n, scale)
