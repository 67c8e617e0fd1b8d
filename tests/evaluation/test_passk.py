"""The unbiased pass@k estimator against brute force over every k-subset of the n samples."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from mcore_rl.evaluation.passk import pass_at_k, summarize_correct

pytestmark = pytest.mark.evaluation


def brute_force(correct: list[bool], k: int) -> float:
    """Fraction of the C(n, k) subsets of size k that contain at least one correct sample."""
    subsets = list(itertools.combinations(range(len(correct)), k))
    return sum(any(correct[i] for i in s) for s in subsets) / len(subsets)


CASES = [
    [True],
    [False],
    [True, False],
    [False, False, True, False],
    [True, True, False, False, False],
    [False] * 7 + [True],
    [True, False, True, False, False, True, False, False],
    [False] * 10,
    [True] * 6,
    [False, True, False, False, True, False, False, False, False, True, False, False],
]


@pytest.mark.parametrize("correct", CASES, ids=lambda c: "".join("1" if x else "0" for x in c))
def test_pass_at_k_equals_brute_force_for_every_k(correct):
    n, c = len(correct), sum(correct)
    for k in range(1, n + 1):
        assert pass_at_k(n, c, k) == pytest.approx(brute_force(correct, k), abs=1e-12), (n, c, k)


def test_known_values_and_closed_forms():
    assert pass_at_k(8, 1, 1) == pytest.approx(1 / 8)
    assert pass_at_k(8, 2, 2) == pytest.approx(1 - math.comb(6, 2) / math.comb(8, 2))  # 13/28
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 3, 3) == 1.0  # n - c < k -> every subset hits
    # large n does not overflow (the product form), and matches the exact rational value
    assert pass_at_k(1000, 3, 100) == pytest.approx(1 - math.comb(997, 100) / math.comb(1000, 100), rel=1e-12)


def test_summary_averages_over_prompts_and_pass_at_1_is_mean():
    rng = np.random.default_rng(0)
    matrix = rng.random((17, 6)) < 0.3
    s = summarize_correct(matrix)
    assert s["mean_at_n"] == pytest.approx(matrix.mean()) == pytest.approx(s["pass_at_1"])
    for k in range(1, 7):
        ref = np.mean([brute_force(list(row), k) for row in matrix])
        assert s[f"pass_at_{k}"] == pytest.approx(ref, abs=1e-12)
    assert s["pass_at_6"] == pytest.approx(matrix.any(axis=1).mean())
    vals = [s[f"pass_at_{k}"] for k in range(1, 7)]
    assert vals == sorted(vals)


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match=r"k=\[9\]"):
        summarize_correct([[True, False]], ks=[1, 9])
    with pytest.raises(ValueError, match="non-empty"):
        summarize_correct(np.zeros((0, 4), dtype=bool))
