"""GSPO through the CLI on the tiny model's task (tests/e2e/sevens.py), sync and async, in one interpreter: real
gradient steps, and the sequence ratio behaving as the anchor says.

sync: one round serves 3 mini-batch updates, so the first is on-policy (the recompute anchor equals the live
weights: every s_i = 1, nothing clipped) and the next two run on weights that moved (s_i spreads far beyond the
paper's band [1 - 3e-4, 1 + 4e-4] at lr 1e-3, and the sequence clip binds). async (PipelineRL-1) with the exact
`snapshot` source: samples one version behind are anchored at the weights that generated them, so their s_i
shows the staleness (the default recompute anchor would hide it: s_i = 1 on a round's only update). ~25 s.
"""

from __future__ import annotations

import pytest

from tests.conftest import run_train_batch
from tests.e2e.sevens import assert_async_lag, assert_trains
from tests.e2e.test_schedules import _last_per_step, sevens  # noqa: F401  (sevens: module fixture)

pytestmark = pytest.mark.e2e
COMMON = ["algorithm=gspo", "trainer.steps=3", "optim.lr=1e-3", "trainer.save_every=0"]
RUNS = {
    "sync": ["algorithm.updates_per_rollout=3"],
    "async": ["schedule=async", "algorithm.max_staleness=1", "algorithm.updates_per_rollout=1",
              "algorithm.old_logp_source=snapshot", "trainer.deterministic=true"],
}


@pytest.fixture(scope="module")
def runs(sevens, tmp_path_factory) -> dict:  # noqa: F811
    """name -> (per-update metrics by update, result) of both runs, one start-up (tests/train_batch.py)."""
    root = tmp_path_factory.mktemp("gspo")
    argv = [[*sevens, *COMMON, *extra, f"run.dir={root / name}"] for name, extra in RUNS.items()]
    results = run_train_batch(argv, root)
    out = {}
    for name, res in zip(RUNS, results):
        assert res.returncode == 0, res.stderr[-4000:]
        out[name] = (_last_per_step(root / name / "metrics.jsonl"), res)
    return out


def _table(recs: dict) -> list[tuple]:
    keys = ("reward_mean", "grad_norm", "seq_clipfrac", "seq_ratio_mean", "seq_ratio_min", "seq_ratio_max",
            "staleness_max")
    return [(s, *(round(r[k], 5) for k in keys)) for s, r in sorted(recs.items())]


def _spread(r: dict) -> float:
    return r["seq_ratio_max"] - r["seq_ratio_min"]


def test_sync_first_update_on_policy_then_the_sequence_clip_binds(runs):
    recs, _ = runs["sync"]
    print("sync (update, reward, grad_norm, seq_clipfrac, s mean/min/max, staleness):", *_table(recs), sep="\n  ")
    assert sorted(recs) == [1, 2, 3]
    first = recs[1]
    assert first["seq_clipfrac"] == 0.0
    assert max(abs(first[k] - 1.0) for k in ("seq_ratio_mean", "seq_ratio_min", "seq_ratio_max")) < 1e-6
    later = [recs[2], recs[3]]
    assert all(_spread(r) > 1e-3 for r in later)               # the anchor stayed at the round's weights
    assert max(r["seq_clipfrac"] for r in later) > 0            # and the paper's band clips some responses
    assert all(r["seq_clipfrac"] < 1 and r["grad_norm"] > 0 for r in later)  # others still carry a gradient
    assert_trains(list(recs.values()))


def test_async_stale_samples_show_in_the_sequence_ratio(runs):
    recs, _ = runs["async"]
    print("async (update, reward, grad_norm, seq_clipfrac, s mean/min/max, staleness):", *_table(recs), sep="\n  ")
    assert sorted(recs) == [1, 2, 3]
    assert abs(recs[1]["seq_ratio_mean"] - 1.0) < 1e-6 and recs[1]["staleness_max"] == 0.0
    stale = [r for r in recs.values() if r["staleness_max"] >= 1]
    assert stale and all(abs(r["seq_ratio_mean"] - 1.0) > 1e-4 or _spread(r) > 1e-4 for r in stale)
    assert_trains(list(recs.values()))
    assert_async_lag(list(recs.values()))
