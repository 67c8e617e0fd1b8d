"""NaN guard: a non-finite loss is skipped on every rank (one all-reduce), the weights and optimizer state stay
bit-identical, the metrics say so (NaN logged as NaN), and K skips in a row stop the run with one line."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mcore_rl.metrics_log import MetricsLogger
from tests.faults.faultlib import checkpoint_tensors, records, train

pytestmark = pytest.mark.faults

RUN = ["trainer.steps=3", "trainer.save_every=1", "trainer.keep_checkpoints=0"]


def _check_skipped_update(run_dir, tmp_path, logger_saw_nan: bool = True) -> None:
    recs = records(run_dir)
    assert sorted(recs) == [1, 2, 3]
    assert recs[2]["nonfinite_skipped"] == 1.0 and recs[2]["update_ok"] == 0.0
    assert math.isnan(recs[2].get("loss", 0.0)) == logger_saw_nan  # logged as NaN, not dropped
    assert recs[1]["nonfinite_skipped"] == 0.0 and recs[3]["nonfinite_skipped"] == 0.0
    assert recs[1]["reward_crashes"] == recs[1]["reward_timeouts"] == recs[1]["reward_errors"] == 0.0  # per step
    # the update after the skip trains on rollouts from the engine that got the (untouched) weights: all finite
    for key in ("loss", "grad_norm", "reward_mean", "train_rollout_logprob_abs_diff"):
        if key in recs[3] or key in ("grad_norm", "reward_mean"):  # loss terms: on rank 0 only if it is the last stage
            assert math.isfinite(recs[3][key]), (key, recs[3][key])
    ck = run_dir / "checkpoints"
    before, after, later = (checkpoint_tensors(ck / f"step_{s:06d}", tmp_path) for s in (1, 2, 3))
    assert before.keys() == after.keys() and len(before) > 10
    for k in before:  # weights AND optimizer moments: bit for bit
        assert torch.equal(before[k], after[k]), k
    assert any(not torch.equal(after[k], later[k]) for k in after)  # the next update did train
    assert all(torch.isfinite(v).all() for v in later.values())
    from safetensors.torch import load_file

    hf = {k: v for f in (run_dir / "hf").glob("*.safetensors") for k, v in load_file(f).items()}
    assert hf and all(torch.isfinite(v).all() for v in hf.values())


def test_nan_loss_skipped_single_rank(tmp_path):
    proc = train(*RUN, f"run.dir={tmp_path / 'run'}", MCORE_RL_INJECT_NAN_AT="2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "update 2: non-finite loss or gradient" in proc.stderr
    _check_skipped_update(tmp_path / "run", tmp_path)


@pytest.mark.multiproc
@pytest.mark.slow  # one torchrun launch: tp2 ~25 s quiet (~45 s loaded), tp2pp2 ~50 s loaded
@pytest.mark.parametrize("parallel,nproc,nan_rank", [("tp2", 2, 1), ("tp2pp2", 4, 3)])
def test_nan_loss_on_one_rank_skipped_by_all(parallel, nproc, nan_rank, tmp_path):
    """NaN only on one (last-stage) rank: rank 0's own loss is finite (or, under PP, absent), yet every rank
    skips the update (they agree through one all-reduce)."""
    proc = train(*RUN, f"parallel={parallel}", f"run.dir={tmp_path / 'run'}", nproc=nproc, timeout=500,
                 MCORE_RL_INJECT_NAN_AT=f"2@{nan_rank}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("update 2: non-finite loss or gradient") == nproc  # every rank skipped
    _check_skipped_update(tmp_path / "run", tmp_path, logger_saw_nan=False)  # rank 0 logs its own finite loss


def test_consecutive_nan_stops_run_keeping_last_good_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    proc = train("trainer.steps=5", "trainer.save_every=1", "trainer.keep_checkpoints=0",
                 "trainer.max_nonfinite_skips=2", f"run.dir={run_dir}", MCORE_RL_INJECT_NAN_AT="2,3")
    assert proc.returncode == 1, proc.stderr[-3000:]
    stops = [line for line in proc.stderr.splitlines() if line.startswith("run stopped:")]
    assert stops == ["run stopped: update 3: 2 consecutive non-finite updates (trainer.max_nonfinite_skips=2); "
                     "stopping, the last checkpoint holds the last good weights"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    recs = records(run_dir)
    assert recs[2]["nonfinite_skipped"] == 1.0 and 3 not in recs
    ck = run_dir / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step_000002"
    # step 2's checkpoint was taken after a skipped update: identical to step 1, all finite
    s1, s2 = checkpoint_tensors(ck / "step_000001", tmp_path), checkpoint_tensors(ck / "step_000002", tmp_path)
    assert all(torch.equal(s1[k], s2[k]) and torch.isfinite(s2[k]).all() for k in s1)
    assert not (ck / "step_000003").exists()


def test_logger_keeps_nonfinite_values(tmp_path):
    log = MetricsLogger(tmp_path, {"tensorboard": False})
    log.log(7, {"loss": float("nan"), "grad_norm": float("inf"), "ok": 1.0})
    rec = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert math.isnan(rec["loss"]) and rec["grad_norm"] == math.inf and rec["ok"] == 1.0
