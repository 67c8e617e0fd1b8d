"""The SGLang client over real loopback HTTP against two `mcore-rl-serve` processes, plus retry behaviour
against an in-process fake, and the NCCL weight-sync path with gloo against a fake worker process."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pickle
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp import web

from mcore_rl.rollout.protocol import GenerationRequest, RolloutEngine, SamplingParams
from mcore_rl.rollout.sglang.api import (
    SAMPLING_FIELDS,
    SGLANG_FIELDS,
    check_payload,
    init_group_payload,
    serialize_named_tensors,
)
from mcore_rl.rollout.sglang.client import AsyncSGLangClient, SGLangClientConfig, SGLangHTTPError
from mcore_rl.rollout.sglang.launcher import LauncherConfig, ServerLauncher, free_port
from mcore_rl.rollout.sglang.remote_engine import SGLangEngine
from mcore_rl.rollout.weight_sync.transports import SyncOptions, send_weights
from tests.rollout.conftest import forward_logprobs
from tests.rollout.sglang_payloads import distributed_update_payload, tensor_update_payload

pytestmark = pytest.mark.rollout
RECORDED: list[tuple[str, dict]] = []  # every payload any client in this module sent


@pytest.fixture(scope="module")
def client(served, tiny_dir, tmp_path_factory):
    eng = SGLangEngine(
        served.worker_urls, model_path=str(tiny_dir), batch_size=3, on_payload=lambda e, p: RECORDED.append((e, p)),
    )  # fmt: skip
    eng.sync_options = SyncOptions(sync_dir=tmp_path_factory.mktemp("sync"), config_dir=tiny_dir, keep_versions=1)
    yield eng
    eng.close()


def post(url: str, body: bytes | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_in_flight(urls: list[str], timeout: float = 30.0) -> None:
    """SGLang refuses /flush_cache while requests run: a cheap probe that a server has our request."""
    end = time.monotonic() + timeout
    while not any(post(u + "/flush_cache", b"{}")[0] == 400 for u in urls):
        assert time.monotonic() < end, "request never showed up in flight"
        time.sleep(0.01)


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def greedy(prompt, n_tokens=8, **kw) -> GenerationRequest:
    return GenerationRequest(
        prompt, SamplingParams(temperature=0.0, max_new_tokens=n_tokens, ignore_eos=True), **kw
    )


def test_batch_generate_with_logprobs(client, tiny_model):
    assert isinstance(client, RolloutEngine) and client.health()
    reqs = [
        GenerationRequest([3, 4, 5], SamplingParams(temperature=0.7, max_new_tokens=6, n=2, seed=3), rid="a"),
        GenerationRequest(list(range(10, 30)), SamplingParams(temperature=1.0, max_new_tokens=9, top_p=0.9)),
        GenerationRequest([7], SamplingParams(temperature=1.2, max_new_tokens=5, top_k=4), rid="c"),
        greedy([8, 9, 10], 7),
    ]
    samples = client.generate(reqs)
    assert [(s.rid, s.sample_index) for s in samples] == [("a", 0), ("a", 1), (None, 0), ("c", 0), (None, 0)]
    for s, t in zip(samples, [0.7, 0.7, 1.0, 1.2, 0.0]):
        ref = forward_logprobs(tiny_model, s.prompt_ids, s.output_ids, t)
        assert (torch.tensor(s.output_logprobs) - ref).abs().max().item() < 1e-4
        assert s.weight_versions == [0] * len(s.output_ids) and s.finish_reason in ("length", "stop")
    assert samples[0].output_ids != samples[1].output_ids
    gen_calls = [p for e, p in RECORDED if e == "/generate"]
    assert [len(p["input_ids"]) for p in gen_calls[-2:]] == [3, 2]  # batch_size=3 -> two batched calls
    again = client.generate(reqs[:1])  # seeds travel as sampling_seed: reproducible
    assert [s.output_ids for s in again] == [s.output_ids for s in samples[:2]]


def test_submit_futures_and_engine_seed(served, tiny_dir):
    from mcore_rl.rollout.protocol import build_engine

    reqs = [GenerationRequest([3, 4, 5], SamplingParams(max_new_tokens=5, n=2)), greedy([6, 7], 3)]
    outs = []
    for _ in range(2):
        eng = build_engine("sglang", worker_urls=served.worker_urls, model_path=str(tiny_dir), seed=11)
        try:
            futures = eng.submit(reqs)
            assert len(futures) == 3
            outs.append([f.result(timeout=60).output_ids for f in futures])
        finally:
            eng.close()
    assert outs[0] == outs[1] and outs[0][0] != outs[0][1]  # engine seed -> reproducible, distinct samples


def test_sglang_yaml_builds_the_engine(served, tiny_dir):
    from mcore_rl.rollout.protocol import build_engine
    from tests.rollout.test_local_engine import engine_kwargs_from_yaml

    name, kwargs = engine_kwargs_from_yaml("sglang", worker_urls=served.worker_urls)
    with build_engine(name, model_path=str(tiny_dir), seed=5, **kwargs) as eng:
        assert isinstance(eng, SGLangEngine) and eng._launcher is None  # running servers given: no launch
        assert eng.generate([greedy([1, 2, 3], 3)])[0].num_output_tokens == 3
        assert kwargs["tp_size"] is None and eng.tp_size == 1  # the yaml leaves it to GET /server_info
    from mcore_rl.config import ConfigError

    with build_engine(name, model_path=str(tiny_dir), seed=5, **{**kwargs, "tp_size": 2}) as eng:
        with pytest.raises(ConfigError, match=r"rollout.tp_size=2 but worker .* runs tp_size=1"):
            eng.tp_size  # noqa: B018 -- read when weight sync first needs it: one line, no rendezvous


def test_abort_in_flight_request(client, served):
    out = {}
    long = GenerationRequest([3, 4], SamplingParams(max_new_tokens=500, ignore_eos=True), rid="long")
    th = threading.Thread(target=lambda: out.setdefault("s", client.generate([long])))
    th.start()
    wait_in_flight(served.worker_urls)
    time.sleep(0.05)
    client.abort("long")
    th.join(timeout=60)
    s = out["s"][0]
    assert s.finish_reason == "abort" and len(s.output_ids) < 500 and s.rid == "long"
    aborts = [p for e, p in RECORDED if e == "/abort_request" and p.get("rid") == "long#0"]
    assert len(aborts) == len(served.worker_urls)  # sent to every worker, not just one


def test_update_weights_from_disk_changes_outputs_and_version(
    client, served, tiny_alt_dir, tiny_alt_model, tiny_model
):
    prompt = [5, 6, 7]
    before = client.generate([greedy(prompt)])[0]
    client.update_weights_from_disk(str(tiny_alt_dir), version=7)
    assert client.weight_version == 7
    assert all(get_json(u + "/model_info")["weight_version"] == "7" for u in served.worker_urls)
    after = client.generate([greedy(prompt, rid="u")])[0]
    assert after.weight_versions == [7] * 8 and after.output_ids != before.output_ids
    ref = forward_logprobs(tiny_alt_model, prompt, after.output_ids, 1.0)
    assert (torch.tensor(after.output_logprobs) - ref).abs().max().item() < 1e-4
    # trainer path: full HF tensors -> versioned safetensors folder -> every server loads it
    named = ((k, v.detach()) for k, v in tiny_model.state_dict().items())
    send_weights("disk", client, named, 8, client.sync_options)
    back = client.generate([greedy(prompt)])[0]
    assert back.output_ids == before.output_ids and back.weight_versions == [8] * 8
    assert [p.name for p in Path(client.sync_options.sync_dir).iterdir()] == ["v00000008"]
    with pytest.raises(SGLangHTTPError, match="400"):
        client.update_weights_from_disk("/nonexistent/folder", version=9)
    assert client.weight_version == 8


def test_pause_abort_then_continue(client, served):
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("a", client.generate([greedy([3, 4], 500, rid="p")])))
    th.start()
    wait_in_flight(served.worker_urls)
    client.pause("abort")
    th.join(timeout=60)
    assert out["a"][0].finish_reason == "abort"
    th2 = threading.Thread(target=lambda: out.setdefault("b", client.generate([greedy([3, 4], 4)])))
    th2.start()
    time.sleep(0.3)
    assert "b" not in out  # held while paused
    client.resume()
    th2.join(timeout=60)
    assert out["b"][0].finish_reason == "length" and len(out["b"][0].output_ids) == 4


def test_every_payload_uses_only_sglang_fields(client, served):
    client.flush_cache()
    start = len(RECORDED)
    client.release_memory()
    client.resume_memory()
    order = [e for e, _ in RECORDED[start:]]  # SGLang releases only from a paused (idle) server
    assert order == ["/pause_generation"] * 2 + ["/release_memory_occupation"] * 2 + [
        "/resume_memory_occupation"] * 2 + ["/continue_generation"] * 2  # fmt: skip
    client.abort(None)
    client.update_weight_version(client.weight_version)
    built = [
        (
            "/update_weights_from_tensor",
            tensor_update_payload([serialize_named_tensors([("w", torch.ones(2))])], 3),
        ),
        (
            "/update_weights_from_distributed",
            distributed_update_payload([("w", torch.ones(2, 3))], "g", 3, True),
        ),
        ("/init_weights_update_group", init_group_payload("127.0.0.1", 1234, 1, 3, "g", "nccl")),
    ]
    seen = set()
    for endpoint, payload in RECORDED + built:
        assert set(payload) <= SGLANG_FIELDS[endpoint], (endpoint, payload)
        sps = payload.get("sampling_params", [])
        for sp in sps if isinstance(sps, list) else [sps]:
            assert set(sp) <= SAMPLING_FIELDS, sp
        seen.add(endpoint)
    assert {"/generate", "/abort_request", "/pause_generation", "/continue_generation", "/flush_cache",
            "/update_weights_from_disk", "/update_weight_version", "/release_memory_occupation",
            "/resume_memory_occupation"} <= seen  # fmt: skip
    # the tensor payload is SGLang's MultiprocessingSerializer format: base64(ForkingPickler dump)
    ((name, t),) = pickle.loads(base64.b64decode(built[0][1]["serialized_named_tensors"][0]))
    assert name == "w" and torch.equal(t, torch.ones(2)) and built[0][1]["weight_version"] == "3"
    # the guard really guards, on both sides of the wire
    with pytest.raises(ValueError, match=r"sampling_params.seed"):
        check_payload("/generate", {"input_ids": [1], "sampling_params": {"seed": 1}})
    url = served.worker_urls[0]
    status, text = post(url + "/generate", b'{"input_ids": [1, 2], "return_logprobs": true}')
    assert status == 200 and "output_token_logprobs" not in text  # unknown top-level: ignored, as SGLang does
    status, text = post(url + "/generate", b'{"input_ids": [1, 2], "sampling_params": {"max_tokens": 3}}')
    assert status == 400 and "sampling_params.max_tokens" in text
    status, text = post(url + "/update_weights_from_disk", b'{"path": "/x"}')
    assert status == 400 and "model_path is required" in text


# ---------------------------------------------------------------------- retries, against an in-process fake
def _fake_app(counts: dict) -> web.Application:
    async def gen(request: web.Request) -> web.Response:
        counts["generate"] = counts.get("generate", 0) + 1
        if counts["generate"] <= 2:
            return web.Response(status=503, text="warming up")
        body = await request.json()
        n = len(body["input_ids"])
        item = {"text": "", "output_ids": [4, 5], "meta_info": {
            "id": "x", "finish_reason": {"type": "length", "length": 2}, "weight_version": "3",
            "output_token_logprobs": [[-0.5, 4, None], [-0.25, 5, None]]}}  # fmt: skip
        return web.json_response([item] * n)

    async def bad(request: web.Request) -> web.Response:
        counts["disk"] = counts.get("disk", 0) + 1
        return web.json_response({"success": False, "message": "no such folder"}, status=400)

    app = web.Application()
    app.add_routes([web.post("/generate", gen), web.post("/update_weights_from_disk", bad)])
    return app


def test_retries_backoff_and_no_retry_on_4xx():
    async def scenario():
        counts: dict = {}
        runner = web.AppRunner(_fake_app(counts))
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        cfg = SGLangClientConfig([f"http://127.0.0.1:{port}"], retries=3, backoff_s=0.05)
        client = AsyncSGLangClient(cfg)
        try:
            t0 = time.monotonic()
            (s,) = await client.generate([GenerationRequest([1, 2], SamplingParams(max_new_tokens=2))])
            assert counts["generate"] == 3 and time.monotonic() - t0 >= 0.05 + 0.1
            assert (
                s.output_ids == [4, 5] and s.output_logprobs == [-0.5, -0.25] and s.weight_versions == [3, 3]
            )
            with pytest.raises(SGLangHTTPError, match="no such folder"):
                await client.update_weights_from_disk("/x", 1)
            assert counts["disk"] == 1
            dead = AsyncSGLangClient(
                SGLangClientConfig([f"http://127.0.0.1:{free_port()}"], retries=2, backoff_s=0.05)
            )
            assert not await dead.health()  # health probes do not retry
            t0 = time.monotonic()
            with pytest.raises(aiohttp.ClientConnectionError):
                await dead.generate([GenerationRequest([1], SamplingParams())])
            assert time.monotonic() - t0 >= 0.05 + 0.1  # two backoffs before giving up
            await dead.close()
        finally:
            await client.close()
            await runner.cleanup()

    asyncio.run(scenario())


# ---------------------------------------------------------------------- NCCL path, with gloo on CPU
def test_update_weights_from_distributed_with_gloo(tmp_path):
    repo = str(Path(__file__).resolve().parents[2])
    cfg = LauncherConfig(
        model_path="unused", num_servers=2, log_dir=str(tmp_path),
        command=["{python}", "-m", "tests.rollout.fake_nccl_worker", "--port", "{port}", "--host", "{host}"],
        env={"PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}, monitor=False, health_timeout_s=120,
    )  # fmt: skip
    torch.manual_seed(0)
    named = [(f"model.layers.{i}.w", torch.randn(32, 32)) for i in range(5)] + [
        ("lm_head.weight", torch.randn(7, 32).bfloat16())
    ]
    with ServerLauncher(cfg) as launcher:
        nccl = {"master_address": "127.0.0.1", "master_port": free_port(), "backend": "gloo"}
        eng = SGLangEngine(
            launcher.worker_urls, nccl=nccl, bucket_mb=0.01,
            on_payload=lambda e, p: RECORDED.append((e, p)),
        )  # fmt: skip
        try:
            send_weights("nccl", eng, iter(named), 3, SyncOptions())  # joins the group (ranks 0, 1, 2) first
            assert eng.weight_version == 3 and list(eng.groups) == ["weight_update_group"]
            joins = sorted(p["rank_offset"] for e, p in RECORDED if e == "/init_weights_update_group")[-2:]
            assert joins == [1, 2]
            for url in launcher.worker_urls:
                calls = get_json(url + "/server_info")["calls"]
                # 4 KiB tensors in 10 KiB buckets: two per bucket; version and flush ride on the last one
                assert [c["names"] for c in calls] == [[n for n, _ in named[i : i + 2]] for i in (0, 2, 4)]
                assert [c["weight_version"] for c in calls] == [None, None, "3"]
                assert [c["flush_cache"] for c in calls] == [False, False, True]
                for name, t in named:
                    body = json.dumps({"name": name, "truncate_size": 100000}).encode()
                    status, text = post(url + "/get_weights_by_name", body)
                    assert status == 200 and torch.equal(torch.tensor(json.loads(text)), t.float().flatten())
        finally:
            eng.close()


# ---------------------------------------------------------------------- servers before weight-update sessions
def test_server_without_session_routes_gets_the_older_sequence(caplog):
    """A server that answers 404 to /begin_weight_update (SGLang < 0.5.23): updates go without a session, the
    404 is remembered per worker and logged once; a group join first destroys the name (its 404 is fine)."""
    calls: list[str] = []

    @web.middleware
    async def record(request: web.Request, handler):
        calls.append(request.path)  # every request, the 404s too
        return await handler(request)

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"success": True, "message": "Success"})

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"tp_size": 1})

    async def scenario():
        app = web.Application(middlewares=[record])
        app.add_routes([web.post("/update_weights_from_tensor", ok), web.post("/init_weights_update_group", ok),
                        web.get("/server_info", info)])  # fmt: skip
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}"
        client = AsyncSGLangClient(SGLangClientConfig([url]))
        try:
            for _ in range(2):
                await client.begin_update()
                await client.update_weights_from_tensor(url, tensor_update_payload(["x"], 1))
                await client.end_update()
            await client.init_weights_update_group("127.0.0.1", 1234, [1], "g", "gloo")
            return client.sessions.legacy == {url}
        finally:
            await client.close()
            await runner.cleanup()

    with caplog.at_level("WARNING"):
        legacy = asyncio.run(scenario())
    assert legacy
    assert calls == ["/begin_weight_update", "/server_info", "/update_weights_from_tensor",
                     "/update_weights_from_tensor", "/destroy_weights_update_group", "/init_weights_update_group"]  # fmt: skip
    assert sum("has no /begin_weight_update" in r.message for r in caplog.records) == 1
