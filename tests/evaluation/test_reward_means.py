"""Held-out evaluation reports the reward itself, not only correctness: a reward model or a judge says nothing about
what is correct, so a run on one is judged by `reward_mean` and the parts' `reward/<key>` means on held-out prompts
(evaluation/scorers.py `RewardScorer.reward_means`, carried into the trainer's eval.jsonl by `_trainer_metrics`)."""

from __future__ import annotations

import pytest

from mcore_rl.data import PromptRecord
from mcore_rl.evaluation.runner import SetResult, _trainer_metrics
from mcore_rl.evaluation.scorers import ReasoningGymScorer, RewardScorer
from mcore_rl.rewards.base import RewardResult


class _Reward:
    """Scores 2, 4, 6, ... with a per-sample metric on every other sample."""

    def score(self, responses, answers, records=None):
        return [
            RewardResult(
                score=2.0 * (i + 1),
                correct=i == 0,
                reason="ok",
                extracted=None,
                metrics={"rm_score": float(i)} if i % 2 == 0 else {},
            )
            for i in range(len(responses))
        ]

    def close(self) -> None:
        pass


def test_reward_scorer_reports_the_mean_reward_and_each_metric_over_the_samples_that_have_it():
    import numpy as np

    scorer = RewardScorer(_Reward())
    recs = [PromptRecord(f"p{i}", "q", "1") for i in range(4)]
    assert scorer.correct(["a", "b", "c", "d"], recs) == [True, False, False, False]
    assert scorer.reward_means() == {"reward_mean": pytest.approx(5.0), "reward/rm_score": pytest.approx(1.0)}
    summary = {
        "mean_at_n": 0.25,
        "pass_at_1": 0.25,
        "num_prompts": 4.0,
        "response_len": 3.0,
        "truncation_rate": 0.0,
        **scorer.reward_means(),
    }
    m = _trainer_metrics(SetResult("s", "s", summary, [], np.ones((4, 1), dtype=bool)), 1)
    assert m["reward_mean"] == pytest.approx(5.0) and m["reward/rm_score"] == pytest.approx(1.0)


def test_a_scorer_without_a_reward_reports_none():
    assert ReasoningGymScorer.reward_means(object.__new__(ReasoningGymScorer)) == {}
