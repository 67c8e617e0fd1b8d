"""`reward=judge`: the parsers by hand, the request body against SGLang 0.5.23's `ChatCompletionRequest` (read from
the wheel by AST), and the client against a stand-in `/v1/chat/completions` on 127.0.0.1 (tests/rewards/stand_in.py):
template filling, retries, timeouts, the API key, the per-call cache, and garbage replies that score 0 with
`parse_error`, are counted, and never stop the step."""

from __future__ import annotations

import logging
import math

import pytest

from mcore_rl.config.checks import ConfigError
from mcore_rl.rewards import build_reward, check_reward, describe, step_metrics
from mcore_rl.rewards.judge import PARSERS, JudgeConfig
from tests.rewards.stand_in import StandIn
from tests.rollout import test_sglang_contract as contract

pytestmark = pytest.mark.rollout
wheel = contract.wheel
PROTOCOL = "sglang/srt/entrypoints/openai/protocol.py"


def _judge(url, **options):
    return build_reward({"name": "judge", "judge": {"url": url, "backoff_s": 0.01, **options}})


def _recs(n, prompt="What is 3 + 4?"):
    return [{"prompt_id": f"p{i}", "prompt": prompt, "answer": "7", "metadata": {}} for i in range(n)]


@pytest.mark.parametrize(
    "parser, content, top, want",
    [
        ("number", "Score: 7 out of 10. Final: 8", None, 0.8),  # the last number
        ("number", "-3", None, 0.0),  # clipped to [0, 1]
        ("number", "I rate it 12.5/10", None, 1.0),  # 10 is the last number
        ("number", "no digits here", None, None),
        ("boxed", "I think \\boxed{6.5} fits, not 9", None, 0.65),
        ("boxed", "\\boxed{good}", None, None),
        ("boxed", "7", None, None),  # a number outside a box is not read by `boxed`
        ("yes_no", "Yes, the answer is right.", None, 1.0),
        ("yes_no", "**No**", None, 0.0),
        ("yes_no", "Maybe yes", None, None),  # the first word decides
        ("yes_no", "", None, None),
        (
            "yes_no_logprobs",
            "Yes",
            [
                {"token": "Yes", "logprob": math.log(0.6)},
                {"token": " no", "logprob": math.log(0.2)},
                {"token": "yes", "logprob": math.log(0.1)},
                {"token": "Maybe", "logprob": -1.0},
            ],
            0.7 / 0.9,
        ),  # variants of a word add up
        ("yes_no_logprobs", "Yes", [{"token": "Sure", "logprob": -0.1}], None),
        ("yes_no_logprobs", "Yes", None, None),  # the server sent no logprobs
    ],
)
def test_parsers_by_hand(parser, content, top, want):
    got = PARSERS[parser](
        {"content": content, "top": top}, JudgeConfig(parser=parser, min_score=0, max_score=10)
    )
    assert got == (pytest.approx(want) if want is not None else None)


def test_scores_template_and_request_body(wheel):
    """The body's fields are ChatCompletionRequest fields of 0.5.23 (AST), with the values the config says; the
    user message is the template filled in; yes_no_logprobs reads the first token's top_logprobs."""
    fields = contract.struct_fields(contract._tree(wheel, PROTOCOL))["ChatCompletionRequest"]
    assert {"messages", "model", "max_tokens", "temperature", "logprobs", "top_logprobs"} <= fields

    def chat(body):
        ok = body["messages"][-1]["content"].endswith("R=7 A=7")
        return ("Yes" if ok else "No"), [
            ("Yes", math.log(0.9 if ok else 0.2)),
            ("No", math.log(0.1 if ok else 0.6)),
        ]

    with StandIn(chat=chat) as srv:
        fn = _judge(
            srv.url + "/v1",
            parser="yes_no_logprobs",
            model="judge-m",
            system="Grade.",
            top_logprobs=3,
            template="Q={prompt} R={response} A={reference}",
            max_tokens=4,
            temperature=0.5,
        )
        try:
            res = fn.score(["7", "8"], ["7", "7"], _recs(2))
        finally:
            fn.close()
    assert [r.score for r in res] == pytest.approx([0.9, 0.25]) and [r.correct for r in res] == [True, False]
    bodies = srv.bodies("/v1/chat/completions")
    assert all(set(b) <= fields for b in bodies)
    assert bodies[0] == {
        "model": "judge-m",
        "max_tokens": 4,
        "temperature": 0.5,
        "logprobs": True,
        "top_logprobs": 3,
        "messages": [
            {"role": "system", "content": "Grade."},
            {"role": "user", "content": "Q=What is 3 + 4? R=7 A=7"},
        ],
    }


def test_identical_requests_are_sent_once_per_call():
    with StandIn(chat=lambda b: ("yes", None)) as srv:
        fn = _judge(srv.url)
        try:
            res = fn.score(["7", "7", "8", "7"], ["7"] * 4, _recs(4))  # same prompt text: 2 distinct bodies
            m = step_metrics(fn, res)
            fn.score(["7"], ["7"], _recs(1))  # the cache lives for one call: sent again
            m2 = fn.metrics()
        finally:
            fn.close()
    assert [r.score for r in res] == [1.0] * 4
    assert len(srv.requests) == 3 and m["reward_judge_requests"] == 2 and m["reward_judge_cache_hits"] == 2
    assert m2["reward_judge_cache_hits"] == 0 and m2["reward_judge_requests"] == 1


def test_garbage_replies_failures_and_retries_never_stop_the_step(caplog):
    """One step: a 500 then success (retried), a hang past the timeout (judge_error:timeout), a body that is no
    ChatCompletionResponse (judge_error:malformed), wordy replies the parser cannot read (parse_error), and good
    replies scored. Counts in metrics, one warning line with the start of an unreadable reply."""

    def chat(body):
        text = body["messages"][-1]["content"]
        return ("Well, it depends on many things." if "WORDY" in text else "Score: 9"), None

    responses = ["7", "HANG", "GARBAGE", "WORDY 1", "WORDY 2", "8"]
    with (
        StandIn(chat=chat, fail_first=1, hang_marker="HANG", garbage_marker="GARBAGE", hang_s=1.5) as srv,
        caplog.at_level(logging.WARNING, logger="mcore_rl.rewards"),
    ):
        fn = _judge(
            srv.url, parser="number", template="{response}", max_concurrency=1, timeout_s=0.5, max_attempts=2
        )
        try:
            res = fn.score(responses, ["7"] * 6, _recs(6))
            m = step_metrics(fn, res)
        finally:
            fn.close()
    assert [(r.score, r.reason) for r in res] == [
        (0.9, "ok"),
        (0.0, "judge_error:timeout"),
        (0.0, "judge_error:malformed"),
        (0.0, "parse_error"),
        (0.0, "parse_error"),
        (0.9, "ok"),
    ]
    assert m["reward_judge_parse_failures"] == 2 and m["reward_judge_errors"] == 2
    assert (
        m["reward_judge_retries"] == 2
        and m["reward_judge_requests"] == 6
        and m["reward_judge_requests_failed"] == 2
    )
    assert len(srv.requests) == 8  # 6 + the first request's retry + the hang's retry
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "judge: 4 of 6 samples scored 0 (judge_error:malformed=1, judge_error:timeout=1, "
        "parse_error=2); an unreadable reply began 'Well, it depends on many things.'"
    ]


def test_api_key_is_sent_and_never_shown(tmp_path):
    key_file = tmp_path / "judge.key"
    key_file.write_text("judge-s3cret\n")
    key_file.chmod(0o600)
    with StandIn(api_key="judge-s3cret") as srv:
        fn = _judge(srv.url, api_key_file=str(key_file))
        anon = _judge(srv.url)
        try:
            assert [r.reason for r in fn.score(["7"], ["7"], _recs(1))] == ["ok"]
            assert [r.reason for r in anon.score(["7"], ["7"], _recs(1))] == ["judge_error:http_401"]
            shown = describe(fn)
        finally:
            fn.close()
            anon.close()
    assert srv.requests[0][2]["Authorization"] == "Bearer judge-s3cret" and len(srv.requests) == 2
    assert "s3cret" not in shown and "api key: from api_key_file" in shown
    assert shown.startswith(
        f"judge http://127.0.0.1:{srv.port}/v1/chat/completions (model=default, parser=yes_no"
    )


def test_judge_errors_count_toward_max_crash_rate():
    from mcore_rl.agreement import FatalRunError

    fn = build_reward(
        {
            "name": "judge",
            "max_crash_rate": 0.5,
            "judge": {"url": "http://127.0.0.1:9", "max_attempts": 1, "timeout_s": 2},
        }
    )
    try:
        with pytest.raises(
            FatalRunError, match=r"reward crashed on 100% of 2 cases .*judge_error:connection"
        ):
            fn.score(["7", "8"], ["7", "7"], _recs(2))
    finally:
        fn.close()


@pytest.mark.parametrize(
    "judge, match",
    [
        ({}, r"reward.judge.url is not set"),
        (
            {"url": "http://h:1", "template": "{prompt} {answer}"},
            r"reward.judge.template: unknown placeholder \{answer\}; use \{prompt\}, \{response\}, \{reference\}",
        ),
        (
            {"url": "http://h:1", "template": "Grade {prompt} against {reference}"},
            r"reward.judge.template has no \{response\} placeholder",
        ),
        ({"url": "http://h:1", "template": "{response:>9}"}, r"unknown placeholder \{response:>9\}"),
        (
            {"url": "http://h:1", "template": "a { b {response}"},
            r"reward.judge.template: .*write \{\{ and \}\}",
        ),
        (
            {"url": "http://h:1", "parser": "json"},
            r"reward.judge.parser='json': expected one of number, boxed, yes_no",
        ),
        (
            {"url": "http://h:1", "min_score": 5, "max_score": 5},
            r"reward.judge.min_score=5 must be below max_score=5",
        ),
        ({"url": "http://h:1", "max_tokens": 0}, r"reward.judge.max_tokens=0 must be > 0"),
        ({"url": "http://h:1", "max_attempts": 0}, r"reward.judge.max_attempts=0 must be > 0"),
    ],
)
def test_bad_judge_settings_are_one_line_config_errors(judge, match):
    with pytest.raises(ConfigError, match=match) as e:
        check_reward({"name": "judge", "judge": judge})
    assert "\n" not in str(e.value)
