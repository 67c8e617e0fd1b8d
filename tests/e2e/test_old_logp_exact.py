"""Exact old log-probs in a real async run (the tiny model's task, tests/e2e/sevens.py; fp32, PipelineRL k=2, partial rollouts): snapshot,
old_logit_model and interrupt equal a reference that reloads every weight version's HF folder and scores that
version's tokens; the trainer's current-weights recompute of the same tokens does not. ~2-3 min per source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_torchrun
from tests.e2e.sevens import TINY_TASK, assert_async_lag, assert_trains

pytestmark = [pytest.mark.e2e, pytest.mark.algorithms, pytest.mark.slow]
WORKER = Path(__file__).with_name("oldlogp_worker.py")
EXACT = ("snapshot", "old_logit_model", "interrupt")


def async_run(tmp_path: Path, source: str, nproc: int = 1, *extra: str) -> dict:
    out = tmp_path / "result.json"
    run_torchrun(nproc, WORKER, str(out), *TINY_TASK, f"run.dir={tmp_path / 'run'}", "rollout.sync_mode=disk",
                 f"rollout.sync_dir={tmp_path / 'sync'}", "rollout.keep_versions=100", "rollout.max_batch_size=1",
                 "algorithm.schedule=async", "algorithm.max_staleness=2",
                 "trainer.deterministic=false",  # free-running async: weight updates land mid-sample
                 f"algorithm.old_logp_source={source}",
                 "algorithm.old_logp_audit_frac=0.5", "algorithm.entropy_coef=0.01", "optim.lr=1e-3",
                 "trainer.steps=5", "trainer.prompts_per_update=2", "trainer.samples_per_prompt=2",
                 "trainer.max_new_tokens=64", "eval.num_prompts=0", "trainer.export_hf=false", "logging.plot=false",
                 "logging.progress=false", "logging.tensorboard=false", *extra, timeout=900)
    return json.loads(out.read_text())


def check_exact(res: dict, source: str) -> None:
    m = res["metrics"]
    print(f"{source}: max|old-ref|={res['max_diff']:.3g} recompute max|diff| on stale tokens="
          f"{res['recompute_max_diff_stale']:.3g} stale tokens={res['stale_tokens']}/{res['tokens']} "
          f"spanning rows={res['spanning_rows']} versions={res['versions']} "
          f"regenerated={m.get('old_logp_regenerated_samples')} snapshots={m.get('old_logp_snapshots')}")
    assert res["source"] == source, res  # the run really used the source under test
    assert res["rounds"] == 5 and len(res["versions"]) >= 3, res
    assert res["stale_tokens"] > 0, "no stale tokens: the run never consumed an older version's tokens"
    assert res["max_diff"] <= 1e-6, (source, res["max_diff"])
    assert res["recompute_max_diff_stale"] > 1e-3, res  # the current weights give the wrong anchor
    if source == "snapshot":
        assert res["spanning_rows"] >= 1, res  # weights changed mid-sample and the sample kept both versions
        assert 1 <= m["old_logp_snapshots"] <= 3  # bounded by max_staleness + 1
    else:  # interrupt / old_logit_model: the mid-sample update restarted the sample instead
        assert res["spanning_rows"] == 0 and m["old_logp_regenerated_samples"] >= 1, res
    # the audit metric sees the same thing: ~0 for an exact source
    assert res["audit_errors"] and max(res["audit_errors"]) <= 1e-6, res["audit_errors"]
    assert_trains(res["records"])
    assert_async_lag(res["records"])


@pytest.mark.parametrize("source", EXACT)
def test_exact_old_logp_single_process(source, tmp_path):
    check_exact(async_run(tmp_path, source), source)


def test_recompute_audit_reports_the_missing_old_logit_error(tmp_path):
    res = async_run(tmp_path, "recompute")
    assert res["max_diff"] > 1e-3  # recompute's own old_logp is off on stale tokens ...
    assert res["recompute_max_diff"] == res["max_diff"]
    assert max(res["audit_errors"]) > 0  # ... and the audit metric makes that visible
