"""`mcore-rl-serve --is-embedding`: SGLang 0.5.23's `/classify` over a real reward model, over real HTTP.

The RM is SmolLM2-135M-Instruct's trunk under a seeded score head (tests/rewards/rm_fixture.py). Its scores must
equal HF's own forward (one unpadded row at a time) although the server batches rows of different lengths with
padding and in chunks; the score is read at the row's last token as SGLang's pooler does (also where that token
is the pad id, where HF reads an earlier one). The accepted and returned fields are checked against the sglang
0.5.23 wheel's source, and the real sglang-router is put in front of two such servers.
"""

from __future__ import annotations

import ast
import json
import urllib.error
import urllib.request

import pytest
import torch

from mcore_rl.rollout.sglang.launcher import LauncherConfig, ServerLauncher
from tests.rewards.rm_fixture import make_smollm2_rm

pytestmark = pytest.mark.rollout
KEY = "classify-test-key"
META_KEYS = {"id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions", "e2e_latency"}


@pytest.fixture(scope="module")
def rm_dir(smollm2_dir, tmp_path_factory):
    return make_smollm2_rm(tmp_path_factory.mktemp("serve_rm"), seed=0)


@pytest.fixture(scope="module")
def hf_rm(rm_dir):
    """HF's model and tokenizer of the RM, loaded once: `hf_ref(rows)` is tests/rewards/rm_fixture.hf_scores."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(rm_dir)


def hf_ref(hf_rm, rows: list[list[int]]) -> list[float]:
    """HF's own forward, one unpadded row at a time (what rm_fixture.hf_scores computes)."""
    with torch.no_grad():
        return [float(hf_rm[0](torch.tensor([r])).logits[0, 0]) for r in rows]


@pytest.fixture(scope="module")
def rm_url(rm_dir, tmp_path_factory):
    """One server with an API key; --max-batch-size 2 so a 3-row batch runs padded, in two chunks."""
    cfg = LauncherConfig(
        model_path=str(rm_dir), server="mcore-rl-serve", api_key=KEY, monitor=False, health_timeout_s=180,
        extra_args=["--is-embedding", "--num-threads", "1", "--max-batch-size", "2"],
        log_dir=str(tmp_path_factory.mktemp("classify_logs")),
    )  # fmt: skip
    with ServerLauncher(cfg) as launcher:
        yield launcher.worker_urls[0]


def call(url: str, path: str, body=None, method: str = "POST", key: str | None = KEY) -> tuple[int, object]:
    data = body if isinstance(body, bytes) else (None if body is None else json.dumps(body).encode())
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, _decode(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, _decode(exc.read())


def _decode(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def chat_rows(tok) -> list[list[int]]:
    """(prompt, response) pairs rendered with the RM's chat template: what a reward client sends."""
    pairs = [("What is 2 + 3?", "5"), ("Name a colour.", "Blue, like the sky on a clear summer day."),
             ("Say hi.", "Hello!")]  # fmt: skip
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
            tokenize=True,
            return_dict=False,
        )  # fmt: skip
        for q, a in pairs
    ]


def test_classify_equals_hf_forward(rm_url, hf_rm):
    """Single and batch, input_ids and text, POST and PUT: each score equals HF's unpadded forward within 1e-4."""
    rows = chat_rows(hf_rm[1])
    texts = ["The answer is 5.", "I do not know, but here is a long guess about it."]
    text_rows = [hf_rm[1](t)["input_ids"] for t in texts]
    want = hf_ref(hf_rm, rows + text_rows)
    s1, one = call(rm_url, "/classify", {"input_ids": rows[1], "rid": "solo"})
    s2, batch = call(rm_url, "/classify", {"input_ids": rows, "rid": ["a", "b", "c"]}, method="PUT")
    s3, tone = call(rm_url, "/classify", {"text": texts[0]})
    s4, tbatch = call(rm_url, "/encode", {"text": texts})
    assert (s1, s2, s3, s4) == (200, 200, 200, 200)
    got = [one["embedding"][0]] + [b["embedding"][0] for b in batch]
    got += [tone["embedding"][0]] + [b["embedding"][0] for b in tbatch]
    ref = [want[1], *want[:3], want[3], *want[3:]]
    assert max(abs(g - r) for g, r in zip(got, ref)) < 1e-4, (got, ref)
    assert min(abs(a - b) for i, a in enumerate(want) for b in want[i + 1 :]) > 1e-3  # the rows really differ
    assert (
        isinstance(one, dict) and isinstance(batch, list) and len(batch) == 3 and len(one["embedding"]) == 1
    )
    assert set(one["meta_info"]) == META_KEYS and one["meta_info"]["id"] == "solo"
    assert [b["meta_info"]["id"] for b in batch] == ["a", "b", "c"]
    assert [b["meta_info"]["prompt_tokens"] for b in batch] == [len(r) for r in rows]
    assert one["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert one["meta_info"]["weight_version"] == "0" and one["meta_info"]["num_retractions"] == 0


def test_last_token_pooling_where_hf_would_skip_a_trailing_pad(rm_url, hf_rm):
    """SGLang pools the row's last position whatever token it is; HF skips trailing pad ids. A row ending with
    the pad id (0 here) gets the last-position score, which differs from HF's pad-skipping one."""
    row = chat_rows(hf_rm[1])[0] + [0]
    model = hf_rm[0]
    pad, model.config.pad_token_id = model.config.pad_token_id, None  # one row, no pad id: HF takes the last
    try:
        with torch.no_grad():
            last = float(model(torch.tensor([row])).logits[0, 0])
    finally:
        model.config.pad_token_id = pad
    status, out = call(rm_url, "/classify", {"input_ids": row})
    assert status == 200 and abs(out["embedding"][0] - last) < 1e-4
    assert abs(out["embedding"][0] - hf_ref(hf_rm, [row])[0]) > 1e-3


BAD = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    ({}, "At least one of text, input_ids"),
    ({"text": "a", "input_ids": [1]}, "cannot be provided at the same time"),
    ({"input_ids": []}, "empty batch"),
    ({"input_ids": [[1, 2], []]}, "item 1 has no tokens"),
    ({"input_ids": [[1], "x"]}, "field 'input_ids' must be"),
    ({"input_ids": [1, 10**9]}, "out of range"),
    ({"input_ids": [5] * 8192}, "longer than the model's context length (8192 tokens)"),
    ({"input_ids": [[1], [2]], "rid": "r"}, "The rid should be a list."),
    ({"input_ids": [[1], [2]], "rid": ["r", "r"]}, "Duplicate request IDs"),
    ({"input_ids": [[1], [2]], "rid": ["r"]}, "rid has 1 entries for a batch of 2"),
    ({"text": [["query", "doc"]]}, "field 'text' must be"),
    ({"text": "a", "lora_path": "x"}, "lora_path='x' is not supported"),
    ({"text": "a", "image_data": "x.png"}, "image_data='x.png' is not supported"),
    ({"text": "a", "dimensions": 8}, "does not support matryoshka representation"),
    ({"text": "a", "return_pooled_hidden_states": True}, "return_pooled_hidden_states=True is not supported"),
]


def test_malformed_requests_are_one_line_400s(rm_url):
    for body, words in BAD:
        status, out = call(rm_url, "/classify", body)
        assert status == 400, (body, status, out)
        msg = out["error"]["message"]
        assert words in msg and "\n" not in msg, (body, msg)
    status, out = call(rm_url, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert status == 400 and "--is-embedding" in out["error"]["message"]
    status, out = call(
        rm_url, "/classify", {"text": "a", "no_such_field": 1}
    )  # SGLang ignores unknown fields
    assert status == 200 and len(out["embedding"]) == 1


def test_auth_health_and_model_info(rm_url, rm_dir):
    assert call(rm_url, "/classify", {"text": "a"}, key=None)[0] == 401
    assert call(rm_url, "/classify", {"text": "a"}, key="wrong")[0] == 401
    assert call(rm_url, "/health", method="GET", key=None)[0] == 200
    assert call(rm_url, "/health_generate", method="GET", key=None)[0] == 200
    status, info = call(rm_url, "/model_info", method="GET")
    assert status == 200 and info["is_generation"] is False and info["model_path"] == str(rm_dir)
    assert info["architectures"] == ["LlamaForSequenceClassification"]


# ---------------------------------------------------------------------- the contract, from the wheel
@pytest.fixture(scope="module")
def wheel():
    import zipfile

    from tests.rollout.test_sglang_contract import CACHE, VERSION

    found = sorted(CACHE.glob(f"sglang-{VERSION}-*.whl"))
    if not found:
        pytest.skip(
            f"sglang {VERSION} wheel not in {CACHE} (tests/rollout/test_sglang_contract.py downloads it)"
        )
    with zipfile.ZipFile(found[-1]) as zf:
        yield zf


def test_fields_routes_and_meta_info_are_sglangs(wheel, tmp_path):
    from mcore_rl.rollout.server import classify
    from tests.rollout.test_sglang_contract import HTTP_SERVER, IO_STRUCT, _tree, routes, struct_fields

    table = routes(_tree(wheel, HTTP_SERVER))
    fields = struct_fields(_tree(wheel, IO_STRUCT))["EmbeddingReqInput"]
    assert {"text", "input_ids", "rid"} <= fields  # the parser really read the struct
    accepted = {*classify.CLASSIFY_TYPES, *classify.CLASSIFY_NEUTRAL, *classify._REFUSALS}
    assert accepted <= fields, sorted(accepted - fields)
    for path in ("/classify", "/encode"):
        assert table[path] == ({"POST", "PUT"}, "EmbeddingReqInput")
    app = classify.build_embedding_app(None, {"model_path": str(tmp_path)}, close_engine=False)
    served = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    assert ("PUT", "/classify") in served and ("GET", "/model_info") in served
    for method, path in sorted(served):
        assert path in table and method in table[path][0], (method, path)
    # meta_info keys and the output dict: string keys the tokenizer manager's batch-output handler writes
    tm = _tree(wheel, "sglang/srt/managers/tokenizer_manager.py")
    (fn,) = [
        f for f in ast.walk(tm) if isinstance(f, ast.AsyncFunctionDef) and f.name == "_handle_batch_output"
    ]
    keys = {n.value for n in ast.walk(fn) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert {"embedding", "meta_info"} | META_KEYS <= keys, sorted(
        ({"embedding", "meta_info"} | META_KEYS) - keys
    )
    # the score position: SGLang's Llama RM pools the last token
    src = wheel.read("sglang/srt/models/llama_reward.py").decode()
    assert "Pooler(pooling_type=PoolingType.LAST, normalize=False)" in src


# ---------------------------------------------------------------------- behind the real sglang-router
@pytest.mark.slow
def test_router_in_front_of_two_embedding_servers(rm_dir, hf_rm, tmp_path):
    """sglang-router 0.3.2 has no /classify or /encode route (404; its classify route is the OpenAI-style
    /v1/classify, which answers softmax probabilities, [1.0] for a one-logit RM): reward clients must call the
    workers' /classify directly. Both workers it fronts give HF's numbers. If a router release starts forwarding
    /classify, the first assertion fails and the routed numbers must then equal the workers'."""
    cfg = LauncherConfig(
        model_path=str(rm_dir), server="mcore-rl-serve", num_servers=2, router=True, monitor=False,
        extra_args=["--is-embedding", "--num-threads", "1"], log_dir=str(tmp_path), health_timeout_s=180,
    )  # fmt: skip
    rows = chat_rows(hf_rm[1])
    want = hf_ref(hf_rm, rows)
    with ServerLauncher(cfg) as launcher:
        routed = [
            call(launcher.router_url, p, {"input_ids": rows}, key=None)[0] for p in ("/classify", "/encode")
        ]
        direct = [call(url, "/classify", {"input_ids": rows}, key=None) for url in launcher.worker_urls]
        status, health = call(launcher.router_url, "/health", method="GET", key=None)
    assert routed == [404, 404], routed
    assert status == 200
    for code, out in direct:
        assert code == 200
        assert max(abs(o["embedding"][0] - w) for o, w in zip(out, want)) < 1e-4


def test_cli_refuses_a_causal_lm_folder_with_is_embedding(tiny_dir, capsys):
    """HF would load a causal LM as a classifier under a random head; the server exits 2 with one line instead."""
    from mcore_rl.rollout.server.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--is-embedding", "--model-path", str(tiny_dir), "--port", "1", "--log-level", "WARNING"])
    assert exc.value.code == 2
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("mcore-rl-serve: error:")]
    assert "['LlamaForCausalLM']" in line and "not a *ForSequenceClassification model" in line


def test_concurrent_requests_share_forwards_and_the_loop_stays_free(rm_url, hf_rm):
    """Requests arriving together are batched by the worker and each gets its own rows' scores back, in order;
    /health answers while a long batch is in the forward (the handler only awaits the worker)."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    rows = chat_rows(hf_rm[1])
    want = hf_ref(hf_rm, rows)
    big = {"input_ids": [rows[1] * 6] * 4}  # 4 rows of ~200 tokens: a second or more on 2 cores
    done = threading.Event()

    def long_call():
        try:
            return call(rm_url, "/classify", big)
        finally:
            done.set()

    with ThreadPoolExecutor(8) as pool:
        slow = pool.submit(long_call)
        time.sleep(0.3)
        status, _ = call(rm_url, "/health", method="GET", key=None)
        health_before_done = not done.is_set()
        futs = [
            pool.submit(call, rm_url, "/classify", {"input_ids": rows[i % 3 :] + rows[: i % 3]})
            for i in range(4)
        ]
        outs = [f.result() for f in futs]
        assert slow.result()[0] == 200
    assert status == 200 and health_before_done
    for i, (code, out) in enumerate(outs):
        ref = want[i % 3 :] + want[: i % 3]
        assert code == 200 and max(abs(o["embedding"][0] - r) for o, r in zip(out, ref)) < 1e-4, i


def test_fuzzed_classify_bodies_never_500(rm_url):
    """Random JSON under /classify's field names (and anything at all): only 200/400/401/429, /health stays up."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from mcore_rl.rollout.server.classify import CLASSIFY_NEUTRAL, CLASSIFY_TYPES
    from tests.rollout.test_server_fuzz import json_values, small_ints

    names = sorted({*CLASSIFY_TYPES, *CLASSIFY_NEUTRAL, "dimensions", "decision_layout", "zzz"})
    rows = st.lists(st.integers(0, 49151), min_size=1, max_size=6)
    value = (
        json_values
        | small_ints
        | rows
        | st.lists(rows, max_size=4)
        | st.lists(st.text(max_size=8), max_size=3)
    )
    seen: set[int] = set()

    valid = st.fixed_dictionaries({"input_ids": rows | st.lists(rows, min_size=1, max_size=3)})
    extra = st.dictionaries(st.sampled_from(names), value, max_size=3)

    @settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(body=st.builds(lambda v, e: {**v, **e}, valid, extra | st.just({})) | extra | json_values)
    def one(body):
        status, _ = call(rm_url, "/classify", body)
        assert status in (200, 400, 401, 429), (body, status)
        seen.add(status)

    one()
    assert {200, 400} <= seen, seen
    assert call(rm_url, "/health", method="GET", key=None)[0] == 200
