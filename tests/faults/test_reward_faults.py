"""Reward workers: an allocation without bound is stopped at the worker's address-space limit (case scores 0,
reason counted, worker replaced); a reward that crashes on every case stops the real trainer with one line."""

from __future__ import annotations

import time

import pytest

from mcore_rl.rewards import CrashRateGuard, MathVerifyConfig, MathVerifyReward, RewardResult, failure_counts
from tests.faults.faultlib import records, train

pytestmark = pytest.mark.faults


def test_unbounded_allocation_hits_memory_limit(monkeypatch):
    monkeypatch.setenv("MCORE_RL_FAULT_REWARD", "alloc")  # every case allocates 64 MiB blocks forever
    fn = MathVerifyReward(MathVerifyConfig(num_workers=2, timeout_s=60.0, memory_limit_mb=256))
    try:
        before = set(fn.pool.pids())
        t0 = time.monotonic()
        res = fn.score(["\\boxed{7}"] * 3, ["7"] * 3)
        took = time.monotonic() - t0
        assert [(r.score, r.reason) for r in res] == [(0.0, "memory_limit")] * 3
        assert took < 30, f"{took:.1f}s: stopped by the deadline, not by the memory limit"
        counts = failure_counts(res)
        assert counts == {"reward_timeouts": 0.0, "reward_crashes": 3.0, "reward_memory_limit": 3.0,
                          "reward_errors": 0.0}
        assert before.isdisjoint(fn.pool.pids()) and fn.pool.respawns == 3  # each one replaced
    finally:
        fn.close()


def test_memory_limit_leaves_normal_cases_alone():
    fn = MathVerifyReward(MathVerifyConfig(num_workers=1, timeout_s=10.0, memory_limit_mb=256))
    try:
        res = fn.score(["so \\boxed{7}", "\\boxed{\\frac{2}{4}}", "8"], ["7", "\\frac{1}{2}", "7"])
        assert [(r.score, r.reason) for r in res] == [(1.0, "correct"), (1.0, "correct"), (0.0, "wrong_answer")]
    finally:
        fn.close()


class _Fixed:
    def __init__(self, reasons: list[str]):
        self.reasons = reasons

    def score(self, responses, answers):
        return [RewardResult(0.0, False, r, None) for r in self.reasons]

    def close(self):
        pass


def test_crash_rate_guard_threshold():
    ok = CrashRateGuard(_Fixed(["worker_crash", "wrong_answer", "timeout", "correct"]), max_crash_rate=0.5)
    assert len(ok.score(["a"] * 4, ["1"] * 4)) == 4  # 25% crashed (a timeout is not a crash)
    bad = CrashRateGuard(_Fixed(["worker_crash", "error:KeyError", "wrong_answer", "correct"]), max_crash_rate=0.5)
    with pytest.raises(RuntimeError, match=r"reward crashed on 50% of 4 cases this step \(e.g. worker_crash\)"):
        bad.score(["a"] * 4, ["1"] * 4)


def test_reward_crashing_on_every_case_stops_the_run(tmp_path):
    run_dir = tmp_path / "run"
    proc = train("trainer.steps=3", f"run.dir={run_dir}", "reward.max_crash_rate=0.5", timeout=240,
                 MCORE_RL_FAULT_REWARD="crash")
    assert proc.returncode == 1, proc.stderr[-3000:]
    stops = [line for line in proc.stderr.splitlines() if line.startswith("run stopped:")]
    assert stops == ["run stopped: reward crashed on 100% of 4 cases this step (e.g. worker_crash), at or above "
                     "reward.max_crash_rate=0.5; fix the reward"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert records(run_dir) == {}  # stopped before the first update trained on all-zero rewards
