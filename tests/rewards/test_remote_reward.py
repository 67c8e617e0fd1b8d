"""`reward=remote` against a real HTTP server on 127.0.0.1 (tests/rewards/rm_server.py): OpenRLHF's request and
response shapes, retries with backoff, per-attempt timeouts, malformed bodies, the API key, the concurrency limit.
Every failure is counted per sample and named in one warning line; the rest of the batch is scored."""

from __future__ import annotations

import logging
import os

import pytest

from mcore_rl.config.checks import ConfigError
from mcore_rl.rewards import build_reward, check_reward, describe, step_metrics
from tests.rewards.rm_server import RewardServer

pytestmark = pytest.mark.rollout

PROMPT = "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"


def _records(n: int) -> list[dict]:
    return [{"prompt_id": f"p{i}", "prompt": [{"role": "user", "content": "What is 3 + 4?"}], "answer": "7",
             "metadata": {}, "prompt_text": PROMPT} for i in range(n)]


def _remote(url, **options):
    return build_reward({"name": "remote", "remote": {"url": url, "backoff_s": 0.01, **options}})


def test_request_bodies_have_openrlhf_shape_and_answers_are_read():
    """The body is exactly what OpenRLHF builds, keys and list lengths: v0.9.0 (06ab51e)
    `openrlhf/utils/remote_rm_utils.py` line 32, `{"query": queries, "prompts": prompts, "labels": labels}`; v0.11.0
    (3c3be62) `openrlhf/utils/agent.py` lines 332-336 (the same three keys, sliced lists) with `query` =
    `hf_tokenizer.decode(prompt + response tokens, skip_special_tokens=False)` (line 283). The response is read as
    there (lines 287-296): `rewards`, `scores` falling back to `rewards`, `extra_logs`; the reference server
    (`openrlhf/cli/serve_rm.py` line 133) answers `{"rewards", "scores", "extra_logs"}`, as rm_server does."""
    responses = ["3 + 4 = 7", "it is 8", "7", "no idea", "so 7.", "12 then 7", "7 or 9"]
    with RewardServer() as srv:
        fn = _remote(srv.url, batch_size=3)
        try:
            res = fn.score(responses, ["7"] * 7, _records(7))
            counts = step_metrics(fn, res)
        finally:
            fn.close()
    assert [r.score for r in res] == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert [r.correct for r in res] == [r.score == 1.0 for r in res]
    assert {r.reason for r in res} == {"ok"}
    assert [set(b) for b in srv.bodies] == [{"query", "prompts", "labels"}] * 3
    assert sorted(len(b[k]) for b in srv.bodies for k in b) == [1, 1, 1, 3, 3, 3, 3, 3, 3]
    sent = sorted((q, p, lab) for b in srv.bodies for q, p, lab in zip(b["query"], b["prompts"], b["labels"]))
    assert sent == sorted((PROMPT + r, PROMPT, "7") for r in responses)
    assert all(h["Content-Type"] == "application/json" and "Authorization" not in h for h in srv.headers)
    assert counts["reward/response_chars"] == pytest.approx(sum(map(len, responses)) / 7)  # extra_logs
    assert counts["reward_remote_requests"] == 3 and counts["reward_remote_failures"] == 0


def test_500_then_success_is_retried_with_backoff():
    with RewardServer(fail_first=2) as srv:
        fn = _remote(srv.url, max_attempts=3, backoff_s=0.05)
        try:
            res = fn.score(["7", "8"], ["7", "7"], _records(2))
            m = step_metrics(fn, res)
        finally:
            fn.close()
    assert [(r.score, r.reason) for r in res] == [(1.0, "ok"), (0.0, "ok")]
    assert len(srv.bodies) == 3 and srv.bodies[0] == srv.bodies[2]  # two 500s, then the same body answered
    assert m["reward_remote_retries"] == 2 and m["reward_remote_failures"] == 0


def test_hang_malformed_and_refused_cost_their_requests_only(caplog):
    """One request per sample (batch_size=1): a hang past the per-attempt timeout (retried once, then counted), a
    bare list (malformed: not retried), a 5xx to the end, and normal samples beside them, all in one step."""
    responses = ["7", "HANG 7", "MALFORMED 7", "FAIL_ONCE 7", "8", "7"]
    with RewardServer(hang_s=2.0) as srv, caplog.at_level(logging.WARNING, logger="mcore_rl.rewards"):
        fn = _remote(srv.url, batch_size=1, timeout_s=0.5, max_attempts=2, max_concurrency=6)
        try:
            res = fn.score(responses, ["7"] * 6, _records(6))
            m = step_metrics(fn, res)
        finally:
            fn.close()
    assert [(r.score, r.reason) for r in res] == [
        (1.0, "ok"), (0.0, "remote_error:timeout"), (0.0, "remote_error:malformed"), (1.0, "ok"), (0.0, "ok"),
        (1.0, "ok")]
    hung = [b for b in srv.bodies if "HANG" in b["query"][0]]
    bare = [b for b in srv.bodies if "MALFORMED" in b["query"][0]]
    assert len(hung) == 2 and len(bare) == 1  # the timeout retried once, the malformed body never
    assert m["reward_remote_failures"] == 2 and m["reward_remote_requests_failed"] == 2
    assert m["reward_remote_retries"] == 2  # the hang's and FAIL_ONCE's
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, lines
    assert "2 of 6 requests failed (malformed=1, timeout=1)" in lines[0] and "2 samples" in lines[0]


def test_bad_status_and_unreachable_and_missing_rewards(tmp_path):
    with RewardServer(bad_requests=(1,)) as srv:
        down = srv.url.replace("/get_reward", "/down")
        fn = build_reward({"name": "remote", "remote": {"urls": [down], "max_attempts": 2, "backoff_s": 0.01}})
        gone = _remote("http://127.0.0.1:9/get_reward", max_attempts=2, timeout_s=2)
        nobody = _remote(srv.url)
        try:
            assert [r.reason for r in fn.score(["7"], ["7"], _records(1))] == ["remote_error:http_503"]
            assert [r.reason for r in gone.score(["7"], ["7"])] == ["remote_error:connection"]
            assert [r.reason for r in nobody.score(["7"], ["7"])] == ["remote_error:malformed"]  # no `rewards`
        finally:
            for f in (fn, gone, nobody):
                f.close()
    assert len(srv.down_bodies) == 2  # the 503 was retried


def test_failover_to_the_next_url_and_concurrency_limit():
    with RewardServer(delay_s=0.1) as srv:
        down = srv.url.replace("/get_reward", "/down")
        fn = build_reward({"name": "remote", "remote": {"urls": [down, srv.url], "batch_size": 1,
                                                        "max_concurrency": 2, "backoff_s": 0.01}})
        try:
            res = fn.score(["7"] * 6, ["7"] * 6, _records(6))
        finally:
            fn.close()
    assert [r.score for r in res] == [1.0] * 6  # requests that started on /down were retried on the other URL
    assert len(srv.down_bodies) == 3 and len(srv.bodies) == 6  # round-robin: every other request started there
    assert srv.max_in_flight == 2


def test_api_key_from_a_file_is_sent_and_never_shown(tmp_path):
    key_file = tmp_path / "rm.key"
    key_file.write_text("s3cret-key\n")
    key_file.chmod(0o600)
    with RewardServer(api_key="s3cret-key") as srv:
        fn = _remote(srv.url, api_key_file=str(key_file))
        anon = _remote(srv.url, max_attempts=3)
        try:
            assert [r.score for r in fn.score(["7"], ["7"], _records(1))] == [1.0]
            assert [r.reason for r in anon.score(["7"], ["7"], _records(1))] == ["remote_error:http_401"]
            shown = describe(fn)
        finally:
            fn.close()
            anon.close()
    assert srv.headers[0]["Authorization"] == "Bearer s3cret-key"
    assert len(srv.bodies) == 2  # the 401 was not retried
    assert "s3cret" not in shown and "remote http://127.0.0.1:" in shown and "api key: from api_key_file" in shown
    os.chmod(key_file, 0o644)
    with pytest.raises(ConfigError, match=r"reward.remote.api_key_file: api key file .* has mode 644"):
        check_reward({"name": "remote", "remote": {"url": "http://h:1/x", "api_key_file": str(key_file)}})


@pytest.mark.parametrize("remote, match", [
    ({}, r"reward.remote.url is not set"),
    ({"url": "ftp://host/x"}, r"'ftp://host/x' is not an http\(s\) URL"),
    ({"url": "http://h/x", "batch_size": 0}, r"reward.remote.batch_size=0 must be > 0"),
    ({"url": "http://h/x", "tokens": 1}, r"reward.remote: unknown option\(s\) \['tokens'\]"),
])
def test_bad_remote_settings_are_config_errors(remote, match):
    with pytest.raises(ConfigError, match=match):
        check_reward({"name": "remote", "remote": remote})


def test_url_credentials_are_not_shown():
    fn = _remote("http://user:pw@127.0.0.1:9/get_reward?token=abc")
    try:
        shown = describe(fn)
    finally:
        fn.close()
    assert "pw" not in shown and "abc" not in shown and "http://127.0.0.1:9/get_reward" in shown
