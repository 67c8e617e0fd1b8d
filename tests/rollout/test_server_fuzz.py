"""`mcore-rl-serve` under hostile input (hypothesis; FUZZ_EXAMPLES=N per endpoint, default 12, for a heavier run): every endpoint, random JSON types and shapes, huge n,
oversized and deeply nested bodies, missing credentials. Only 200/400/401/413/429 may come back, /health stays
200 and the server's RSS stays bounded. A real server subprocess (its own RSS, its real limits and auth)."""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from collections import Counter

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mcore_rl.rollout.sglang.api import SAMPLING_TYPES, SGLANG_TYPES
from mcore_rl.rollout.sglang.launcher import LauncherConfig, ServerLauncher

pytestmark = pytest.mark.rollout
ALLOWED = {200, 400, 401, 413, 429}
KEY = "fuzz-secret-key"
GET_ONLY = ["/health", "/health_generate", "/model_info", "/get_model_info", "/server_info", "/get_server_info"]
ENDPOINTS = sorted(SGLANG_TYPES)
SEEN: Counter = Counter()  # (endpoint, status) over the fuzz run: proves it reached past the type checks


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("key") / "key"
    key_file.write_text(KEY)
    key_file.chmod(0o600)  # the server refuses a key file others may read
    cfg = LauncherConfig(
        model_path=str(tiny_dir), server="mcore-rl-serve", log_dir=str(tmp_path_factory.mktemp("fuzz_logs")),
        extra_args=["--num-threads", "1", "--api-key-file", str(key_file), "--max-body-bytes", str(256 * 1024),
                    "--max-samples-per-request", "8", "--max-queued-samples", "16"],
        health_timeout_s=120, monitor=False,
    )  # fmt: skip
    with ServerLauncher(cfg) as launcher:
        yield launcher


def call(url: str, method: str, body: bytes | None, auth: bool = True, timeout: float = 60) -> int:
    headers = {"Content-Type": "application/json"}
    if auth:
        headers["Authorization"] = f"Bearer {KEY}"
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code


def reset(base: str) -> None:
    """Undo state a fuzzed call may leave (paused, memory released) so later examples are independent."""
    for path in ("/continue_generation", "/resume_memory_occupation"):
        assert call(base + path, "POST", b"{}") == 200
    assert call(base + "/end_weight_update", "POST", b"{}") in (200, 400)  # 400: no session was open


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)
small_ints = st.integers(-3, 40) | st.sampled_from([0, 1, 2**31, 2**63, 10**9, 10**30])
sampling = st.dictionaries(
    st.sampled_from(sorted(SAMPLING_TYPES)) | st.sampled_from(["max_tokens", "seed", "bogus"]),
    small_ints | st.floats(-2, 3) | st.booleans() | st.text(max_size=5) | st.lists(small_ints, max_size=4) | json_values,
    max_size=6,
)


@st.composite
def bodies(draw, endpoint: str):
    """Mostly the endpoint's real field names with values of random type; sometimes anything at all."""
    if draw(st.integers(0, 9)) == 7:
        return draw(json_values)
    # hypothesis favours small draws (False, 0): the common cases get the large values below
    if endpoint == "/generate" and not draw(st.booleans()):  # a valid request, then maybe one field spoiled
        body = {
            "input_ids": draw(st.lists(st.integers(0, 255), min_size=1, max_size=6)),
            "sampling_params": {"max_new_tokens": draw(st.integers(1, 8)), "n": draw(st.integers(1, 3)),
                                "temperature": draw(st.floats(0, 2))},
            "return_logprob": draw(st.booleans()),
        }  # fmt: skip
        if draw(st.booleans()):
            body[draw(st.sampled_from(sorted(SGLANG_TYPES[endpoint])))] = draw(json_values | small_ints)
        return body
    fields = sorted(SGLANG_TYPES[endpoint]) + ["model", "return_hidden_states", "zzz"]
    out = {}
    for name in draw(st.lists(st.sampled_from(fields), max_size=5, unique=True)):
        if name == "input_ids":
            out[name] = draw(st.lists(small_ints, max_size=6) | st.lists(st.lists(small_ints, min_size=1,
                                                                                  max_size=4), max_size=4)
                             | json_values)  # fmt: skip
        elif name == "sampling_params":
            out[name] = draw(sampling | st.lists(sampling, max_size=3) | json_values)
        else:
            out[name] = draw(json_values | small_ints)
    return out


@pytest.mark.parametrize("endpoint", ENDPOINTS + GET_ONLY)
@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "12")), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(data=st.data())
def test_fuzz_every_endpoint(server, endpoint, data):
    base = server.worker_urls[0]
    if endpoint in GET_ONLY:
        status = call(base + endpoint, "GET", None, auth=data.draw(st.booleans()))
    else:
        body = data.draw(bodies(endpoint))
        garbage = data.draw(st.integers(0, 9)) == 7
        raw = data.draw(st.binary(max_size=50)) if garbage else json.dumps(body).encode()
        status = call(base + endpoint, "POST", raw, auth=data.draw(st.integers(0, 9)) != 7)
    assert status in ALLOWED, (endpoint, status)
    SEEN[endpoint, status] += 1
    reset(base)


def test_fuzz_reached_every_endpoint_and_status():
    statuses = {s for _, s in SEEN}
    assert {200, 400, 401} <= statuses, SEEN
    assert {e for e, s in SEEN if s == 200} >= {"/generate", "/abort_request", "/pause_generation"}, SEEN
    print(sorted(SEEN.items()), file=sys.stderr)


def test_limits_auth_and_health_after_abuse(server):
    base = server.worker_urls[0]
    proc = psutil.Process(server.servers[0].popen.pid)
    rss0 = proc.memory_info().rss
    gen = base + "/generate"
    assert call(gen, "POST", b'{"input_ids": [1, 2]}', auth=False) == 401
    assert call(base + "/health", "GET", None, auth=False) == 200  # open, as in SGLang
    assert call(gen, "POST", b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}') == 200
    huge_n = {"input_ids": [1, 2], "sampling_params": {"n": 10**6, "max_new_tokens": 2}}
    assert call(gen, "POST", json.dumps(huge_n).encode()) == 429
    big = json.dumps({"input_ids": [1] * 200_000}).encode()
    assert len(big) > 256 * 1024 and call(gen, "POST", big) == 413
    deep = b"[" * 100_000 + b"]" * 100_000  # balanced: the JSON parser itself recurses too deep
    assert call(gen, "POST", deep) == 400
    assert call(gen, "POST", b'{"input_ids": [1], "sampling_params": {"n": 2.5}}') == 400
    assert call(gen, "POST", b'{"input_ids": [1], "sampling_params": 5}') == 400
    # queued work: 3 concurrent requests of 8 samples each > 16 queued -> at least one 429, none other than 200
    import concurrent.futures as cf

    slow = json.dumps({"input_ids": [1, 2], "sampling_params": {"n": 8, "max_new_tokens": 200, "ignore_eos": True}})
    with cf.ThreadPoolExecutor(3) as pool:
        statuses = sorted(pool.map(lambda _: call(gen, "POST", slow.encode()), range(3)))
    assert statuses[0] == 200 and statuses[-1] == 429, statuses
    for _ in range(20):
        call(gen, "POST", big)
        call(gen, "POST", deep)
    rss1 = proc.memory_info().rss
    assert call(base + "/health", "GET", None) == 200
    assert rss1 - rss0 < 200 * 2**20, f"server RSS grew {(rss1 - rss0) / 2**20:.0f} MiB"
    print(f"server RSS {rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB", file=sys.stderr)
