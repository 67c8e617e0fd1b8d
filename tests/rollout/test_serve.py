"""`mcore-rl-serve` response shapes and rules, exercised in-process (aiohttp test server over the local engine)."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer

from mcore_rl.rollout.local.engine import LocalEngine
from mcore_rl.rollout.server.app import build_app

pytestmark = pytest.mark.rollout


@pytest.fixture(scope="module")
def tiny_engine(tiny_dir):
    eng = LocalEngine(str(tiny_dir))
    yield eng
    eng.close()


def run(engine, scenario):
    """Run `scenario(client)` against a fresh in-process server on `engine`."""

    async def main():
        app = build_app(engine, {"model_path": engine.model_path}, close_engine=False)
        async with TestClient(TestServer(app)) as client:
            return await scenario(client)

    return asyncio.run(main())


def test_generate_shapes_and_finish_reasons(tiny_engine):
    async def scenario(c):
        single = await (await c.post("/generate", json={
            "input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "rid": "one"})).json()  # fmt: skip
        batch = await (await c.post("/generate", json={
            "input_ids": [[3, 4], [5, 6, 7]], "rid": "b",
            "sampling_params": {"max_new_tokens": 3, "n": 2, "sampling_seed": 1, "ignore_eos": True}})).json()  # fmt: skip
        stop_tok = single["output_ids"][1]
        stopped = await (await c.post("/generate", json={
            "input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                        "stop_token_ids": [stop_tok]}})).json()  # fmt: skip
        return single, batch, stopped, stop_tok

    single, batch, stopped, stop_tok = run(tiny_engine, scenario)
    meta = single["meta_info"]
    assert meta["id"] == "one" and meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 4 and meta["weight_version"] == "0"
    assert [t for _, t, _ in meta["output_token_logprobs"]] == single["output_ids"]
    assert all(lp < 0 and txt is None for lp, _, txt in meta["output_token_logprobs"])
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 4}] and meta["e2e_latency"] > 0
    # batch with n=2: a list, prompt-major (SGLang's order), rid string expanded per prompt
    assert isinstance(batch, list) and [b["meta_info"]["id"] for b in batch] == ["b_0", "b_0", "b_1", "b_1"]
    assert (
        batch[0]["output_ids"] != batch[1]["output_ids"]
        and "output_token_logprobs" not in batch[0]["meta_info"]
    )
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    assert stopped["output_ids"] == single["output_ids"][:2]


def test_abort_flush_version_and_event_loop_stays_free(tiny_engine):
    async def scenario(c):
        long = asyncio.create_task(c.post("/generate", json={
            "input_ids": [3, 4], "rid": "L", "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}))  # fmt: skip
        while (await c.post("/flush_cache")).status != 400:  # refused while a request runs
            await asyncio.sleep(0.005)
        t0 = time.perf_counter()
        health = await c.get("/health")
        health_latency = time.perf_counter() - t0
        assert (await c.post("/abort_request", json={"rid": "L"})).status == 200
        res = await (await long).json()
        for _ in range(200):  # the engine thread drops the aborted row just after its future resolves
            flushed = await c.post("/flush_cache")
            if flushed.status == 200:
                break
            await asyncio.sleep(0.01)
        upd = await (await c.post("/update_weight_version", json={"new_version": "12"})).json()
        info = await (await c.get("/model_info")).json()
        hg = await c.get("/health_generate")
        bad = await c.post("/update_weight_version", json={"new_version": "v2"})
        return (
            health.status,
            health_latency,
            res,
            flushed.status,
            upd,
            info,
            hg.status,
            (bad.status, await bad.text()),
        )

    status, latency, res, flushed, upd, info, hg, bad_version = run(tiny_engine, scenario)
    assert status == 200 and latency < 1.0  # generation runs off the event loop
    assert res["meta_info"]["finish_reason"]["type"] == "abort" and len(res["output_ids"]) < 500
    assert flushed == 200 and upd["success"] and info["weight_version"] == "12" and hg == 200
    assert bad_version[0] == 400 and "new_version='v2'" in bad_version[1]
    tiny_engine.set_weight_version(0)


def test_unsupported_and_invalid_requests_are_400_naming_the_field(tiny_engine):
    cases = [
        ({"input_ids": [1], "sampling_params": {"foo": 1}}, "unknown key sampling_params.foo"),
        ({"input_ids": [1], "sampling_params": {"n": 2.5}}, "sampling_params.n must be int"),
        ({"input_ids": [1], "sampling_params": 5}, "'sampling_params' must be dict or list[dict]"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 10**9}}, "exceeds the context length 512"),
        ({"input_ids": [1], "sampling_params": {"min_p": 0.1}}, "min_p"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [1], "stream": True}, "stream"),
        ({"input_ids": [1], "logprob_start_len": 0}, "logprob_start_len"),
        ({"text": "hi"}, "tokenizer"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params has 1 entries"),
        ({"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 2}]}, "n must be the same"),
        ({"sampling_params": {}}, "exactly one of text or input_ids"),
        ({"input_ids": [1, 9999]}, "out of range"),
    ]

    async def scenario(c):
        out = []
        for body, _ in cases:
            r = await c.post("/generate", json=body)
            out.append((r.status, await r.text()))
        ok = await c.post(  # unknown TOP-level fields (sglang-router adds some) are ignored, as SGLang does
            "/generate", json={"input_ids": [1], "sampling_params": {"min_p": 0.0, "max_new_tokens": 1},
                               "model": "x", "return_hidden_states": False, "no_logs": True},
        )  # fmt: skip
        tensor = await c.post("/update_weights_from_tensor", json={"serialized_named_tensors": []})
        return out, ok.status, tensor.status, await tensor.text()

    out, ok, tensor_status, tensor_text = run(tiny_engine, scenario)
    for (status, text), (_, needle) in zip(out, cases):
        assert status == 400 and needle in text, (needle, status, text)
    assert ok == 200  # neutral values of unimplemented SGLang options are fine
    # outside a begin/end_weight_update session, as SGLang 0.5.23 (the session tests: test_sglang_contract.py)
    assert tensor_status == 400 and "must run between begin_weight_update()" in tensor_text


def test_text_input_and_text_logprobs_with_smollm2(smollm2_dir):
    with LocalEngine(str(smollm2_dir)) as eng:

        async def scenario(c):
            return await (await c.post("/generate", json={
                "text": ["The capital of France is", "1, 2, 3,"], "return_logprob": True,
                "return_text_in_logprobs": True,
                "sampling_params": {"max_new_tokens": 5, "temperature": 0, "stop": ["\n"]}})).json()  # fmt: skip

        res = run(eng, scenario)
    assert len(res) == 2 and " 4" in res[1]["text"]
    for r in res:
        pieces = "".join(txt for _, _, txt in r["meta_info"]["output_token_logprobs"])
        assert r["text"] and pieces.startswith(r["text"].rstrip("\n"))


def test_updates_outside_a_session_are_refused_as_sglang_does(tiny_engine, tiny_dir):
    """SGLang 0.5.23's weight-update session rules and words (the strings: test_sglang_contract.py); the
    transports themselves run in test_sglang_contract.py against a server process."""
    from mcore_rl.rollout.server import weight_update as wu

    calls = [
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["x"]}),
        ("/update_weights_from_distributed", {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]]}),
        ("/end_weight_update", {}),
        ("/begin_weight_update", {"selector": "both"}),
        ("/begin_weight_update", {"selector": "target"}),
        ("/begin_weight_update", {}),
        ("/end_weight_update", {}),
        ("/update_weights_from_disk", {"model_path": str(tiny_dir)}),
    ]

    async def scenario(c):
        out = []
        for path, body in calls:
            r = await c.post(path, json=body)
            out.append((r.status, await r.json()))
        return out

    tensor, dist, end, bad, begin, again, close, disk = run(tiny_engine, scenario)
    refused = wu.OUTSIDE_SESSION.format
    assert tensor == (400, {"success": False, "message": refused(op="update_weights_from_tensor")})
    assert dist == (400, {"success": False, "message": refused(op="update_weights_from_distributed")})
    assert end == (400, {"success": False, "message": wu.NO_SESSION})
    assert bad[0] == 400 and "selector" in str(bad[1])
    assert begin == (200, {"success": True, "message": "Success"})
    assert again == (400, {"success": False, "message": wu.SESSION_OPEN})
    assert close == (200, {"success": True, "message": "Success"})
    assert disk[0] == 200 and disk[1]["success"] is True  # disk updates need no session
