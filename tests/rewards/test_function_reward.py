"""Reward functions from user code (`reward=function`): a module written to a temporary folder on sys.path, imported
inside the sandboxed workers. A function that sleeps past the deadline, raises, allocates without bound, exits the
interpreter or returns NaN or a string costs its own sample only (scored 0, counted, named in one log line)."""

from __future__ import annotations

import logging
import sys
import textwrap
import time
from multiprocessing import forkserver

import pytest

from mcore_rl.config.checks import ConfigError
from mcore_rl.rewards import CrashRateGuard, RewardResult, build_reward, check_reward, describe, step_metrics
from mcore_rl.rewards.registry import CombinedReward

pytestmark = pytest.mark.rollout

USER_MODULE = textwrap.dedent('''
    import asyncio, math, os, time

    LIMIT = 3

    def score(response, answer, record):
        if "SLEEP" in response:
            time.sleep(60)
        if "RAISE" in response:
            raise KeyError("no such thing")
        if "ALLOC" in response:
            hog = []
            while True:
                hog.append(bytearray(64 * 2**20))
        if "EXIT" in response:
            os._exit(9)
        if "NAN" in response:
            return float("nan")
        if "STR" in response:
            return "1.0"
        return {"score": float(response.endswith(answer)), "chars": len(response), "a": record["metadata"]["a"]}

    def plain(response, answer, record):
        return 0.5

    async def batch(responses, answers, records):
        await asyncio.sleep(0)
        if any("SHORT" in r for r in responses):
            return [1.0]
        return [math.inf if "INF" in r else {"score": 1.0, "correct": False} for r in responses]

    def two_args(response, answer):
        return 1.0
''')


@pytest.fixture(scope="module")
def usermod(tmp_path_factory):
    """The module's name; its folder is put on sys.path (what PYTHONPATH does for a CLI run)."""
    folder = tmp_path_factory.mktemp("usercode")
    name = "mcore_rl_test_reward_fns"
    (folder / f"{name}.py").write_text(USER_MODULE)
    sys.path.insert(0, str(folder))
    yield name
    sys.path.remove(str(folder))
    sys.modules.pop(name, None)


def _records(n: int) -> list[dict]:
    return [{"prompt_id": f"p{i}", "prompt": "q", "answer": "7", "metadata": {"a": i}} for i in range(n)]


def test_each_misbehaviour_costs_its_sample_only(usermod, caplog):
    fn = build_reward({"name": "function", "max_crash_rate": 0.9,
                       "function": {"path": f"{usermod}:score", "timeout_s": 3, "memory_limit_mb": 256}})
    responses = ["so 7", "SLEEP", "8", "RAISE", "ALLOC", "it is 7", "EXIT", "NAN", "STR", "7"]
    try:
        before = set(fn.inner.pool.pids())
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="mcore_rl.rewards"):
            res = fn.score(responses, ["7"] * 10, _records(10))
        took = time.monotonic() - t0
        m = step_metrics(fn, res)
        assert fn.inner.pool.respawns == 3 and before.isdisjoint(fn.inner.pool.pids())  # sleep, alloc, exit
    finally:
        fn.close()
    assert [(r.score, r.reason) for r in res] == [
        (1.0, "ok"), (0.0, "timeout"), (0.0, "ok"), (0.0, "error:KeyError"), (0.0, "memory_limit"), (1.0, "ok"),
        (0.0, "worker_crash"), (0.0, "invalid:nan"), (0.0, "invalid:str"), (1.0, "ok")]
    assert [r.correct for r in res] == [r.score >= 1 for r in res]
    assert took < 20, f"{took:.1f}s: the sleeper was not stopped at its deadline"
    assert {k: m[k] for k in ("reward_timeouts", "reward_crashes", "reward_memory_limit", "reward_errors",
                              "reward_invalid")} == {"reward_timeouts": 1.0, "reward_crashes": 2.0,
                                                     "reward_memory_limit": 1.0, "reward_errors": 1.0,
                                                     "reward_invalid": 2.0}
    assert m["reward/a"] == pytest.approx((0 + 2 + 5 + 9) / 4)  # the record's metadata reached the function
    assert m["reward/chars"] == pytest.approx((4 + 1 + 7 + 1) / 4)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert lines == [f"reward function {usermod}:score: 6 of 10 samples scored 0 by a failure (error:KeyError=1, "
                     "invalid:nan=1, invalid:str=1, memory_limit=1, timeout=1, worker_crash=1)"]


def test_batched_async_function(usermod):
    fn = build_reward({"name": "function", "function": {"path": f"{usermod}:batch", "batched": True,
                                                        "batch_size": 2, "num_workers": 1}})
    try:
        assert "batched, batch_size=2, async" in describe(fn)
        res = fn.score(["a", "INF", "SHORT", "b", "c"], ["7"] * 5)
    finally:
        fn.close()
    assert [(r.score, r.correct, r.reason) for r in res] == [
        (1.0, False, "ok"), (0.0, False, "invalid:inf"),  # the dict's own `correct` wins over full marks
        (0.0, False, "invalid:batch_length"), (0.0, False, "invalid:batch_length"),  # the whole call: wrong length
        (1.0, False, "ok")]


def test_a_folder_added_after_the_forkserver_started_reaches_the_workers(tmp_path):
    forkserver.ensure_running()  # its sys.path is frozen from here on
    (tmp_path / "late_rewards.py").write_text("def score(response, answer, record):\n    return 0.25\n")
    sys.path.insert(0, str(tmp_path))
    try:
        fn = build_reward({"name": "function", "function": {"path": "late_rewards:score", "num_workers": 1}})
        try:
            assert [r.score for r in fn.score(["x"], ["1"])] == [0.25]
        finally:
            fn.close()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("late_rewards", None)


def test_two_functions_and_a_builtin_combine_with_weights(usermod):
    cfg = {"name": "function+function2+format", "weights": {"function": 1.0, "function2": 0.5, "format": 0.1},
           "function": {"path": f"{usermod}:score", "num_workers": 1},
           "function2": f"{usermod}:plain",  # the one-string form: reward.function2=module:function
           "format": {"check": "boxed"}}
    check_reward(cfg)
    fn = build_reward(cfg)
    try:
        assert isinstance(fn, CombinedReward)
        res = fn.score(["\\boxed{7} = 7", "NAN"], ["7", "7"], _records(2))
        shown = describe(fn)
    finally:
        fn.close()
    assert [r.score for r in res] == pytest.approx([1.0 + 0.5 * 0.5 + 0.1, 0.0 + 0.5 * 0.5 + 0.0])
    assert res[1].reason == "function=invalid:nan,function2=ok,format=format_bad"
    # the function's own metrics, and each part's unweighted score (logged as reward/<part>)
    assert res[0].metrics == {"chars": 13.0, "a": 0.0, "function": 1.0, "function2": 0.5, "format": 1.0}
    assert f"1 * function: function {usermod}:score" in shown and f"0.5 * function2: function {usermod}:plain" in shown
    assert "0.1 * format: FormatReward(check=boxed" in shown


@pytest.mark.parametrize("path, match", [
    (None, r"reward.function.path is not set: give module:function"),
    ("nosuch_module_xyz:score", r"reward.function.path='nosuch_module_xyz:score': cannot import module "
                                r"'nosuch_module_xyz' \(ModuleNotFoundError"),
    ("{mod}:nope", r"reward.function.path='{mod}:nope': module '{mod}' has no attribute 'nope'"),
    ("{mod}:LIMIT", r"'LIMIT' in '{mod}' is a int, not a function"),
    ("{mod}", r"expected 'module:function'"),
    ("{mod}:two_args", r"must take \(response, answer, record\); its signature is \(response, answer\)"),
])
def test_an_unimportable_function_is_a_one_line_config_error(usermod, path, match):
    path = path.format(mod=usermod) if path else path
    with pytest.raises(ConfigError, match=match.format(mod=usermod)):
        check_reward({"name": "function", "function": {"path": path}})


@pytest.mark.parametrize("cfg, match", [
    ({"name": "function2x"}, r"reward.name='function2x': expected one of"),
    ({"name": "format+format"}, r"names a part twice"),
    ({"name": "function", "function": {"timeout_s": 0}}, r"reward.function.timeout_s=0 must be > 0"),
])
def test_bad_reward_names_and_values(cfg, match):
    with pytest.raises(ConfigError, match=match):
        check_reward(cfg)


class _Invalid:
    def score(self, responses, answers):  # an old-style reward: no records argument
        return [RewardResult(0.0, False, "invalid:nan" if i % 2 else "ok", None) for i in range(len(responses))]

    def close(self):
        pass


def test_invalid_scores_count_toward_the_crash_rate_and_old_rewards_still_work():
    guard = CrashRateGuard(_Invalid(), max_crash_rate=0.5)
    with pytest.raises(RuntimeError, match=r"reward crashed on 50% of 4 cases this step \(e.g. invalid:nan\)"):
        guard.score(["a"] * 4, ["1"] * 4, _records(4))  # records are dropped for a score() without them
    assert len(CrashRateGuard(_Invalid(), max_crash_rate=0.6).score(["a"] * 4, ["1"] * 4, _records(4))) == 4
