"""`algorithm=rloo` and `algorithm=reinforce_pp` through the CLI on the tiny model's task (tests/e2e/sevens.py), each
sync and async (PipelineRL-1), three updates per run, in one interpreter (`run_train_batch`): real gradient steps on
groups with reward variance, stale samples consumed under async, REINFORCE++'s KL return charged once the policy
has left the reference, and a group of one response refused by RLOO in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_train_batch
from tests.e2e.sevens import TINY_TASK, assert_async_lag, assert_trains

pytestmark = pytest.mark.e2e

BASE = [*TINY_TASK, "eval.num_prompts=0", "trainer.prompts_per_update=2", "trainer.samples_per_prompt=4",
        "trainer.max_new_tokens=16", "trainer.steps=3", "logging.progress=false", "logging.plot=false",
        "trainer.export_hf=false"]
ASYNC = ["schedule=async", "algorithm.max_staleness=1"]
RUNS = {
    "rloo_sync": ["algorithm=rloo", "algorithm.ratio_level=sequence"],
    "rloo_async": ["algorithm=rloo", *ASYNC, "algorithm.ratio_level=token", "algorithm.adv_std_norm=batch"],
    "reinforce_pp_sync": ["algorithm=reinforce_pp", "algorithm.reward_kl_coef=0.05",
                          "algorithm.reward_kl_estimator=k2"],
    "reinforce_pp_async": ["algorithm=reinforce_pp", *ASYNC, "algorithm.baseline=group"],
    # last: the refusal stops a run mid-way (after its first round), leaving nothing for a later run to meet
    "rloo_group_of_one": ["algorithm=rloo", "trainer.samples_per_prompt=1", "trainer.steps=1"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[list[dict], object]]:
    root = tmp_path_factory.mktemp("rloo_reinforce_pp")
    argv = [[*BASE, *extra, f"run.dir={root / name}"] for name, extra in RUNS.items()]
    out = {}
    for (name, _), res in zip(RUNS.items(), run_train_batch(argv, root)):
        path = Path(root / name / "metrics.jsonl")
        recs = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        out[name] = (recs, res)
    return out


@pytest.mark.parametrize("name", ["rloo_sync", "rloo_async", "reinforce_pp_sync", "reinforce_pp_async"])
def test_trains_sync_and_async(runs, name):
    recs, res = runs[name]
    assert res.returncode == 0, res.stderr[-4000:]
    assert [r["step"] for r in recs] == [1, 2, 3]
    print(f"{name}: reward_mean, grad_norm, reward_kl per update: "
          f"{[(r['reward_mean'], round(r['grad_norm'], 4), r.get('reward_kl')) for r in recs]}")
    assert_trains(recs)
    if name.endswith("async"):
        assert_async_lag(recs)
    else:  # on-policy, one update per round: the ratio the clip sees is 1 (the anchor is the update's own forward)
        assert all(r["ratio_mean"] == pytest.approx(1.0, abs=1e-5) for r in recs)
    if name.startswith("reinforce_pp"):
        assert all(r["adv_whiten_std"] > 0 for r in recs)
        # the reference is the initial policy: no KL before the first update, some once the policy has moved (k1
        # estimates may be negative)
        assert recs[0]["reward_kl"] == pytest.approx(0.0, abs=1e-6) and any(r["reward_kl"] != 0.0 for r in recs[1:])


def test_rloo_refuses_a_group_of_one_in_one_line(runs):
    _, res = runs["rloo_group_of_one"]
    assert res.returncode == 2, res.stderr[-4000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("config error:")]
    assert errors == ["config error: algorithm 'rloo': a prompt group of one response has no baseline from the "
                      "other responses; set trainer.samples_per_prompt >= 2"], res.stderr[-3000:]
    assert "Traceback" not in res.stderr
