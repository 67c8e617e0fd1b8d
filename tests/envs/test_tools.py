"""Tool calls: the three formats, malformed calls, the `calc` evaluator and the sandboxed pool's limits."""

from __future__ import annotations

import time

import pytest

from mcore_rl.envs.base import Tool
from mcore_rl.envs.calc import CalcError, evaluate
from mcore_rl.envs.tool_calls import TOOL_FORMATS, parse_tool_calls
from mcore_rl.envs.tools import ToolRunner

CALC = Tool(
    "calc",
    "arithmetic",
    {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    "mcore_rl.envs.calc:evaluate",
)
SLEEP = Tool(
    "sleep",
    "",
    {"type": "object", "properties": {"seconds": {"type": "number"}}},
    "tests.envs.hostile_tools:sleep",
)
HOG = Tool(
    "hog", "", {"type": "object", "properties": {"mb": {"type": "integer"}}}, "tests.envs.hostile_tools:hog"
)
BOOM = Tool("boom", "", {"type": "object", "properties": {}}, "tests.envs.hostile_tools:boom")


def test_qwen_format_one_json_object_per_tag():
    reply = (
        'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "12*3"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calc", "arguments": "{\\"expression\\": \\"7+1\\"}"}\n</tool_call>'
    )
    calls = parse_tool_calls(reply, "qwen")
    assert [(c.name, c.arguments, c.valid) for c in calls] == [
        ("calc", {"expression": "12*3"}, True),
        ("calc", {"expression": "7+1"}, True),
    ]
    assert parse_tool_calls("The answer is \\boxed{4}.", "qwen") == []


def test_smollm2_format_accepts_a_list_of_calls():
    reply = '<tool_call>[{"name": "calc", "arguments": {"expression": "1+1"}}, {"name": "calc", "arguments": {}}]</tool_call>'
    calls = parse_tool_calls(reply, "smollm2")
    assert [(c.name, c.arguments) for c in calls] == [("calc", {"expression": "1+1"}), ("calc", {})]


def test_llama_format_json_with_parameters_and_separators():
    reply = '<|python_tag|>{"name": "calc", "parameters": {"expression": "2**10"}}; {"name": "calc", "arguments": {"expression": "3"}}'
    calls = parse_tool_calls(reply, "llama")
    assert [(c.name, c.arguments) for c in calls] == [
        ("calc", {"expression": "2**10"}),
        ("calc", {"expression": "3"}),
    ]
    assert parse_tool_calls("The answer is 4.", "llama") == []


@pytest.mark.parametrize(
    "reply, error",
    [
        ("<tool_call>{not json}</tool_call>", "invalid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'needs a string "name"'),
        ('<tool_call>{"name": "calc", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "calc", "arguments": "{oops"}</tool_call>', "not valid JSON"),
        ('<tool_call>["calc"]</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "calc", "arguments": {"expression": "1+', "invalid JSON"),  # cut mid-call
    ],
)
def test_malformed_calls_are_marked_not_raised(reply, error):
    (call,) = parse_tool_calls(reply, "qwen")
    assert not call.valid and error in call.error


def test_tool_formats_are_a_registry():
    assert {"qwen", "smollm2", "llama"} <= set(TOOL_FORMATS.names())


@pytest.mark.parametrize(
    "expr, value",
    [
        ("48213*77 - 19", "3712382"),
        ("(99999+1)*123456789", "12345678900000"),
        ("7/2", "3.5"),
        ("2^10", "1024"),
        ("-3 + +4", "1"),
        ("1,234 + 1", "1235"),
        ("10 // 3 + 10 % 3", "4"),
        ("1/3", "0.3333333333"),
    ],
)
def test_calc_is_exact(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize(
    "expr, why",
    [
        ("__import__('os').system('true')", "unsupported syntax"),
        ("x + 1", "unsupported syntax"),
        ("(1).__class__", "unsupported syntax"),
        ("9**9**9", "exponents"),
        ("10**60 * 10**60", "too large"),
        ("1/0", "division by zero"),
        ("1 +", "cannot parse"),
        ("1" * 201, "longer than"),
        ("", "non-empty"),
        ("'a' * 3", "unsupported syntax"),
        ("[1]", "unsupported syntax"),
    ],
)
def test_calc_refuses_without_eval(expr, why):
    with pytest.raises(CalcError, match=why):
        evaluate(expr)


@pytest.fixture(scope="module")
def runner():
    r = ToolRunner([CALC, SLEEP, HOG, BOOM], num_workers=2, timeout_s=1.5, memory_limit_mb=64)
    yield r
    r.close()


def _calls(*pairs):
    from mcore_rl.envs.tool_calls import ToolCall

    return [ToolCall(name, args) for name, args in pairs]


def test_runner_answers_every_call_with_text(runner):
    from mcore_rl.envs.tool_calls import ToolCall

    calls = [
        ToolCall("calc", {"expression": "6*7"}),
        ToolCall("calc", {"expression": "9**9**9"}),
        ToolCall("nope", {}),
        ToolCall("calc", {"expr": "1"}),
        ToolCall("", error="invalid JSON in tool call"),
        ToolCall("boom", {}),
    ]
    res = runner.run(calls)
    assert [(r.ok, r.reason) for r in res] == [
        (True, "ok"),
        (False, "tool_error"),
        (False, "unknown_tool"),
        (False, "malformed"),
        (False, "malformed"),
        (False, "error:RuntimeError"),
    ]
    assert res[0].text == "42"
    assert res[1].text.startswith("Error: exponents")
    assert "available: boom, calc, hog, sleep" in res[2].text
    assert (
        "unknown argument(s) ['expr']" in res[3].text or "missing argument(s) ['expression']" in res[3].text
    )
    assert res[5].text == "Error: RuntimeError: tool bug"


def test_hang_and_memory_hog_cost_one_call_each(runner):
    respawns = runner.pool.respawns
    t0 = time.monotonic()
    res = runner.run(
        _calls(("sleep", {"seconds": 60}), ("hog", {"mb": 4096}), ("calc", {"expression": "2+2"}))
    )
    took = time.monotonic() - t0
    assert [r.reason for r in res] == ["timeout", "memory_limit", "ok"]
    assert res[0].text == "Error: the tool did not answer within 1.5s" and res[2].text == "4"
    assert took < 30  # the hang was killed at its deadline, not waited out
    assert runner.pool.respawns == respawns + 2  # each bad worker replaced...
    # ...and the pool serves on
    assert [r.text for r in runner.run(_calls(("calc", {"expression": "1+1"})))] == ["2"]
    assert runner.stats.reasons["timeout"] >= 1


def test_crashing_worker_gives_an_error_message_not_an_exception():
    r = ToolRunner([CALC], num_workers=1, timeout_s=2.0, fault="crash")
    try:
        (res,) = r.run(_calls(("calc", {"expression": "1+1"})))
        assert (res.ok, res.reason, res.text) == (False, "worker_crash", "Error: the tool crashed")
    finally:
        r.close()
