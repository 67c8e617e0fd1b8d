"""`mcore-rl-train` with an exact old-log-prob source and the audit metric, through the real CLI (tiny model)."""

from __future__ import annotations

import pytest

from tests.conftest import run_train_batch
from tests.e2e.sevens import assert_async_lag, assert_trains
from tests.e2e.test_train_tiny import FAST, records

pytestmark = [pytest.mark.e2e, pytest.mark.algorithms]


@pytest.fixture(scope="module")
def batch(tmp_path_factory) -> dict:
    """Both runs in one interpreter (tests/train_batch.py). name -> (run folder, result)."""
    root = tmp_path_factory.mktemp("old_logp_cli")
    runs = {
        "snapshot": [*FAST, "trainer.steps=3", f"run.dir={root / 'snapshot'}", "algorithm.schedule=async",
                     "algorithm.max_staleness=1", "algorithm.old_logp_source=snapshot",
                     "algorithm.old_logp_audit_frac=1.0", "algorithm.entropy_coef=0.01", "optim.lr=1e-3",
                     "eval.num_prompts=0", "trainer.export_hf=false", "logging.plot=false"],
        "unknown": [*FAST, "trainer.steps=1", f"run.dir={root / 'unknown'}", "algorithm.old_logp_source=exactish"],
    }  # fmt: skip
    results = run_train_batch(list(runs.values()), root)
    return {name: (root / name, res) for name, res in zip(runs, results)}


def test_cli_async_snapshot_logs_memory_and_missing_old_logit_error(batch):
    run_dir, proc = batch["snapshot"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = records(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert 1 <= r["old_logp_snapshots"] <= 2  # max_staleness + 1
        assert r["old_logp_snapshot_gb"] > 0
        assert r["old_logp_error"] <= 1e-6  # snapshot is exact: the audit agrees with it
    assert max(r["old_logp_stale_token_frac"] for r in recs) > 0  # async k=1: some rounds were stale
    assert_trains(recs)
    assert_async_lag(recs)


def test_cli_rejects_unknown_source(batch):
    _, proc = batch["unknown"]
    assert proc.returncode != 0
    assert "old_logp_source='exactish' is not one of" in proc.stderr
