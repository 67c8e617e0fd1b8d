"""PPO-EWMA keeps learning under async k=2 through the CLI (tiny model, rewards that vary within groups):
with exact old logits (snapshot) the Train-Infer Mask compares the engine with the trainer at the same version
and keeps every token; with rollout (no old logits) the EWMA proximal anchor's gate tolerates the staleness the
clip allows.
And a configuration that would keep something the loss never reads is refused before any model is built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_train_batch
from tests.e2e.sevens import assert_async_lag, assert_trains
from tests.e2e.test_schedules import _last_per_step, sevens  # noqa: F401  (sevens: module fixture)

pytestmark = pytest.mark.e2e
ASYNC = ["algorithm=ppo_ewma", "schedule=async", "algorithm.max_staleness=2",
         "algorithm.updates_per_rollout=1", "trainer.steps=5", "trainer.prompts_per_update=4",
         "trainer.save_every=0", "optim.lr=1e-3", "trainer.deterministic=true"]


SOURCES = {"snapshot": "algorithm.old_logp_audit_frac=0.5", "rollout": "algorithm.reset_clip_frac=0.6"}
# override -> what the one config-error line says (each with the snapshot source unless it names its own)
REFUSED = {"algorithm.ewma_beta=0.5": "ewma_beta set with old_logp_source=snapshot",
           "algorithm.reset_clip_frac=0.9": "reset_clip_frac set with old_logp_source=snapshot",
           "algorithm.old_logp_source=recompute": "old_logp_source=recompute computes log-probs its loss never reads"}


@pytest.fixture(scope="module")
def batch(sevens, tmp_path_factory) -> dict:  # noqa: F811
    """The two async runs and the refused configurations, in one interpreter (tests/train_batch.py).
    name -> (run folder, result)."""
    root = tmp_path_factory.mktemp("ppo_ewma")
    runs = {src: [*sevens, *ASYNC, f"algorithm.old_logp_source={src}", extra, f"run.dir={root / src}"]
            for src, extra in SOURCES.items()}
    for i, override in enumerate(REFUSED):
        source = [] if "old_logp_source" in override else ["algorithm.old_logp_source=snapshot"]
        runs[override] = [*sevens, "algorithm=ppo_ewma", *source, override,
                          f"run.dir={root / f'refused{i}'}"]
    results = run_train_batch(list(runs.values()), root)
    return {name: (Path(args[-1].split("=", 1)[1]), res) for (name, args), res in zip(runs.items(), results)}


@pytest.mark.parametrize("source", list(SOURCES))
def test_async_k2_keeps_learning(batch, source):
    run_dir, proc = batch[source]
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = _last_per_step(run_dir / "metrics.jsonl")
    assert sorted(recs) == [1, 2, 3, 4, 5]
    rows = [(s, r["staleness_max"], r["ti_keep_rate"], r["grad_norm"], r["pg_clipfrac"], r.get("ewma_reset"),
             r["reward_mean"]) for s, r in sorted(recs.items())]
    print(f"{source}: (update, staleness, keep, grad_norm, clipfrac, reset, reward)", *rows, sep="\n  ")
    assert [r["staleness_max"] for r in recs.values()][2:] == [2.0, 2.0, 2.0]     # data two versions stale
    assert all(r["grad_norm"] > 0 for r in recs.values())                        # learning never stops
    stale = [r for r in recs.values() if r["staleness_max"] >= 1]
    assert all(r["ti_keep_rate"] >= 0.5 for r in stale)
    assert_trains(list(recs.values()))                                           # rewards vary, every update learns
    assert_async_lag(list(recs.values()))
    gen = json.loads((run_dir / "summary.jsonl").read_text().splitlines()[-1])["phases"]["generate"]
    assert gen["overlapped"] and gen["tokens_per_s"] is None  # the trainer's wait is not the engine's rate
    if source == "snapshot":  # exact: fp32 engine and trainer agree to rounding, d = pi_old / pi_infer = 1
        assert all(r["ti_keep_rate"] == 1.0 and abs(r["ti_ratio_mean"] - 1) < 1e-5 for r in recs.values())
        assert all(r["ti_within_0.005"] == 1.0 for r in recs.values())  # the noise floor, logged every update
        assert all(r["old_logp_error_max"] < 1e-5 for r in stale)  # pi_old to fp32 rounding (audit layout)
        assert all("ewma_reset" not in r and "ewma_age" not in r for r in recs.values())  # no EWMA kept
        assert max(r["pg_clipfrac"] for r in stale) > 0                            # staleness shows in s
    else:
        assert sum(r["ewma_reset"] for r in recs.values()) < len(recs)
        assert recs[5]["ewma_age"] > 0


@pytest.mark.parametrize("override", list(REFUSED))
def test_unread_configuration_exits_2(batch, override):
    run_dir, proc = batch[override]
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if "config error" in ln]
    assert len(lines) == 1 and REFUSED[override] in lines[0], proc.stderr[-2000:]
    assert proc.seconds < 60  # refused before any model is built
    assert not (run_dir / "metrics.jsonl").exists()
