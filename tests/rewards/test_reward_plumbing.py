"""How rewards are wired: every `reward.function.*` / `reward.remote.*` key set through the override grammar and its
effect asserted; the records the trainer's round hands a reward (trainer/rounds.py `_score`), the held-out scorer's
and an environment's; the reward metrics of a step; the start-up description."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from mcore_rl.data.records import PromptRecord
from mcore_rl.envs.base import Episode, score_reply
from mcore_rl.evaluation.scorers import RewardScorer
from mcore_rl.rewards import RewardResult, build_reward, describe
from mcore_rl.rollout.protocol import Sample
from mcore_rl.trainer.rounds import Rounds
from mcore_rl.trainer.schedule import Generated
from tests.config.keyscan import compose
from tests.rewards.rm_server import RewardServer

pytestmark = pytest.mark.rollout

BATCH_SIZES = "def sizes(responses, answers, records):\n    return [float(len(responses))] * len(responses)\n"


@pytest.fixture
def sizes_module(tmp_path):
    (tmp_path / "reward_sizes.py").write_text(BATCH_SIZES)
    sys.path.insert(0, str(tmp_path))
    yield "reward_sizes"
    sys.path.remove(str(tmp_path))
    sys.modules.pop("reward_sizes", None)


def test_function_keys_through_the_override_grammar(sizes_module):
    cfg = compose(["reward=function", f"reward.function.path={sizes_module}:sizes", "reward.function.batched=true",
                   "reward.function.batch_size=3", "reward.function.num_workers=1", "reward.function.timeout_s=7",
                   "reward.function.memory_limit_mb=512", "reward.function.mp_context=spawn",
                   "reward.function.startup_timeout_s=90", "reward.max_crash_rate=0.25",
                   "+reward.weights.function=2.0"])
    fn = build_reward(cfg.reward)
    try:
        res = fn.score(list("abcdefg"), ["1"] * 7)
        inner = fn.inner.parts[0][1]  # weights.function=2.0: a weighted (combined) reward
        pool = inner.pool
        assert (pool.timeout_s, pool.num_workers, pool.startup_timeout_s) == (7.0, 1, 90.0)
        assert pool.options.memory_limit_mb == 512 and pool._ctx.get_start_method() == "spawn"
        assert fn.max_crash_rate == 0.25
    finally:
        fn.close()
    assert [r.score for r in res] == [6.0] * 6 + [2.0]  # batches of 3, 3, 1, weighted by 2


def test_remote_keys_through_the_override_grammar(tmp_path):
    key = tmp_path / "k"
    key.write_text("grammar-key")
    key.chmod(0o600)
    with RewardServer(api_key="grammar-key", fail_first=1) as srv:
        cfg = compose(["reward=remote", f"reward.remote.url={srv.url}", f"reward.remote.urls=[{srv.url}]",
                       "reward.remote.batch_size=2", "reward.remote.max_concurrency=1", "reward.remote.timeout_s=9",
                       "reward.remote.max_attempts=2", "reward.remote.backoff_s=0.02",
                       f"reward.remote.api_key_file={key}"])
        fn = build_reward(cfg.reward)
        try:
            res = fn.score(["7", "8", "7"], ["7"] * 3)
            shown = describe(fn)
        finally:
            fn.close()
    assert [r.score for r in res] == [1.0, 0.0, 1.0]
    assert sorted(len(b["query"]) for b in srv.bodies) == [1, 2, 2]  # batches of 2 and 1, the 500 retried
    assert srv.max_in_flight == 1
    assert shown.startswith(f"remote http://127.0.0.1:{srv.port}/get_reward (OpenRLHF protocol; batch_size=2, "
                            "max_concurrency=1, timeout_s=9 per attempt, max_attempts=2, backoff_s=0.02, "
                            "api key: from api_key_file); max_crash_rate=0.5")


class _Spy:
    """A reward that keeps what it was given (records included) and reports a metric and a counter."""

    uses_text = True

    def __init__(self):
        self.records = None

    def score(self, responses, answers, records=None):
        self.records = records
        return [RewardResult(1.0 if r.endswith(a) else 0.0, r.endswith(a), "ok", None, 0.0, {"len": len(r)})
                for r, a in zip(responses, answers)]

    def metrics(self):
        return {"spy_calls": 1.0}

    def close(self):
        pass


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        assert skip_special_tokens is False  # OpenRLHF's query keeps the template's special tokens
        return "".join(f"<{i}>" for i in ids)


def test_the_round_hands_each_sample_its_prompt_record():
    rec = PromptRecord("q1", [{"role": "user", "content": "3 + 4?"}], "7", {"a": 3, "b": 4})
    data = SimpleNamespace(train=[rec], tokenizer=_Tok(), observe=lambda ids, rewards: None)
    spy = _Spy()
    rounds = Rounds(None, 0, 2, 1, SimpleNamespace(dynamic_sampling=False, max_sampling_rounds=1), data=data,
                    reward_fn=spy, compute=SimpleNamespace(add_round=lambda *a: None))
    samples = [Sample("r", [1, 2], [5], [0.0], [0], "stop", text="is 7"),
               Sample("r", [1, 2], [6, 9], [0.0, 0.0], [0, 0], "stop", text="8")]
    rewards, correct, metrics = rounds._score(Generated(0, [SimpleNamespace(prompt_id="q1", prompt_ids=[1, 2],
                                                                           answer="7")], samples))
    assert rewards == [1.0, 0.0] and correct == [True, False]
    assert spy.records == [{**rec.to_dict(), "prompt_text": "<1><2>", "query": "<1><2><5>"},
                           {**rec.to_dict(), "prompt_text": "<1><2>", "query": "<1><2><6><9>"}]
    assert metrics["reward/len"] == 2.5 and metrics["spy_calls"] == 1.0 and metrics["reward_invalid"] == 0.0


def test_heldout_scorer_and_environments_pass_records():
    spy = _Spy()
    rec = PromptRecord("h1", "What is 3 + 4?", "7", {"source": "t"})
    assert RewardScorer(spy).correct(["so 7"], [rec]) == [True]
    assert spy.records == [rec.to_dict()]
    trainer_prompt = SimpleNamespace(prompt_id="h2", prompt_ids=[1], answer="7")  # the default held-out set's
    RewardScorer(spy).correct(["x"], [trainer_prompt])
    assert spy.records == [{"prompt_id": "h2", "prompt": None, "answer": "7", "metadata": {}}]
    result = score_reply(spy, Episode(rec, 0, []), "7")
    assert result.score == 1.0 and spy.records == [rec.to_dict()]
