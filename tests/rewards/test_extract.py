"""Answer extraction and format checks (pure functions, no processes)."""

import time

import pytest

from mcore_rl.rewards.extract import (
    extract_answer,
    final_line_is_number,
    has_boxed_answer,
    last_boxed,
    max_brace_depth,
    tail,
)
from mcore_rl.rewards.format_reward import FormatConfig, FormatReward

pytestmark = pytest.mark.rollout


@pytest.mark.parametrize(
    "text, candidate, method",
    [
        ("3 + 4 = 7", "7", "last_number"),
        ("7", "7", "last_number"),
        ("The sum of 12 and 9 is 21.", "21", "last_number"),
        ("1,000 apples", "1000", "last_number"),
        ("so it is \\frac{1}{2}", "\\frac{1}{2}", "last_number"),
        ("ratio 1/2", "1/2", "last_number"),
        ("The answer is 42. Because 40 + 2 = 42", "42", "phrase"),
        ("Final answer: $\\frac{3}{4}$.", "\\frac{3}{4}", "phrase"),
        ("answer is **-5**", "-5", "phrase"),
        ("First \\boxed{1}, then \\boxed{\\frac{a}{b^{2}}} done", "\\frac{a}{b^{2}}", "boxed"),
        ("The answer is 3, i.e. \\boxed{3}", "3", "boxed"),
    ],
)
def test_extract_answer(text, candidate, method):
    ext = extract_answer(text)
    assert ext is not None
    assert (ext.candidate, ext.method) == (candidate, method)


@pytest.mark.parametrize("text", ["no digits here", "", "\\boxed{", "１２ full-width digits are not ASCII"])
def test_extract_answer_none(text):
    assert extract_answer(text) is None


def test_last_boxed_unclosed_and_nested():
    assert last_boxed("\\boxed{x^{2}") is None
    assert last_boxed("\\fbox{a{b}c}") == "a{b}c"
    assert max_brace_depth("\\frac{1}{(2+[3])}") == 3


def test_tail_keeps_the_end():
    text = "a" * 100 + "The answer is 7"
    assert tail(text, 20) == text[-20:]
    assert extract_answer(tail(text, 20)).candidate == "7"


def test_extraction_is_linear_on_adversarial_input():
    # Inputs that make naive regexes backtrack quadratically; all must finish fast.
    blobs = ["1," * 200_000, "answer is " * 50_000, "\\boxed{" * 100_000, "9" * 400_000, "{" * 400_000]
    t0 = time.perf_counter()
    for b in blobs:
        extract_answer(b)
        max_brace_depth(b)
        final_line_is_number(b)
    assert time.perf_counter() - t0 < 3.0


def test_format_checks_and_reward():
    assert has_boxed_answer("so \\boxed{7}") and not has_boxed_answer("\\boxed{ }")
    assert final_line_is_number("work\n3 + 4 = 7.\n\n")
    assert not final_line_is_number("7 is the answer\nI hope that helps")
    fr = FormatReward(FormatConfig(check="boxed_or_final_number"))
    res = fr.score(["\\boxed{2}", "3 + 4 = 7", "seven", None, ""], ["2", "7", "7", "7", "7"])
    assert [r.score for r in res] == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert [r.reason for r in res] == ["format_ok", "format_ok", "format_bad", "invalid_response:NoneType", "format_bad"]
    assert not any(r.correct for r in res)
    with pytest.raises(ValueError, match="format.check='nope' unknown"):
        FormatReward(FormatConfig(check="nope"))
