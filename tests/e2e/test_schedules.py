"""Schedules through the CLI on the tiny model's task, where rewards vary (tests/e2e/sevens.py): async (PipelineRL-2) exact
resume after SIGKILL, async stale_policy=requeue, DAPO dynamic sampling, P3O with ess_scope=batch (single process
and DP=2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_train_batch
from tests.e2e.sevens import TINY_TASK, assert_async_lag, assert_trains

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def sevens() -> list[str]:
    return [*TINY_TASK, "eval.num_prompts=0", "trainer.prompts_per_update=2", "trainer.samples_per_prompt=4",
            "trainer.max_new_tokens=16", "logging.progress=false", "logging.plot=false", "trainer.export_hf=false"]


def _train(args: list[str], env: dict | None = None, timeout: int = 400, torchrun: int = 0):
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(torchrun)] \
        if torchrun else [sys.executable]
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([*launch, "-m", "mcore_rl.train", *args], capture_output=True, text=True, timeout=timeout,
                          env=e, cwd=REPO)


def _requeue_args(run_dir: Path) -> list[str]:
    return [*TINY_TASK, "model.load_check.enabled=false", "schedule=async", "algorithm.stale_policy=requeue",
            "trainer.deterministic=true", "trainer.prompts_per_update=2", "trainer.samples_per_prompt=2",
            "trainer.max_new_tokens=4", "trainer.save_every=2", "trainer.export_hf=false", "data.sampler.shuffle=false",
            "eval.num_prompts=0", "logging.progress=false", "logging.plot=false", "logging.tensorboard=false",
            f"run.dir={run_dir}", f"hydra.run.dir={run_dir.parent / 'hydra'}"]


def _dapo_args(sevens: list[str], run_dir: Path) -> list[str]:
    return [*sevens, "algorithm=dapo", "trainer.steps=3", "algorithm.updates_per_rollout=1", f"run.dir={run_dir}"]


def _p3o_args(sevens: list[str], run_dir: Path) -> list[str]:
    return [*sevens, "algorithm=p3o", "algorithm.ess_scope=batch", "trainer.steps=3", "optim.lr=1e-3",
            "algorithm.updates_per_rollout=3", "trainer.prompts_per_update=4", f"run.dir={run_dir}"]


@pytest.fixture(scope="module")
def batch(sevens, tmp_path_factory) -> dict:
    """This module's single-process runs, in one interpreter (tests/train_batch.py: one start-up for all; the
    requeue test's two runs in order on one run folder). name -> (run folder, result)."""
    root = tmp_path_factory.mktemp("schedules")
    runs = {"dapo": (root / "dapo", _dapo_args(sevens, root / "dapo")),
            "p3o": (root / "p3o", _p3o_args(sevens, root / "p3o"))}
    requeue = _requeue_args(root / "requeue" / "run")
    runs["requeue_k2"] = (root / "requeue" / "run", [*requeue, "algorithm.max_staleness=2", "trainer.steps=2"])
    runs["requeue_k1"] = (root / "requeue" / "run", [*requeue, "algorithm.max_staleness=1", "trainer.steps=4"])
    results = run_train_batch([args for _, args in runs.values()], root)
    return {name: (folder, res) for (name, (folder, _)), res in zip(runs.items(), results)}


def _last_per_step(path: Path, key: str = "step") -> dict[int, dict]:
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        out[rec[key]] = rec  # a resumed run appends: its record of an update comes last
    return out


ASYNC = ["schedule=async", "algorithm.max_staleness=2", "trainer.deterministic=true", "trainer.steps=6",
         "trainer.save_every=2", "optim.lr=1e-3", "algorithm.entropy_coef=0.01"]


@pytest.mark.faults
@pytest.mark.slow  # three runs: ~75 s of CPU, 1.5-3 min wall per source
@pytest.mark.parametrize("source", ["rollout", "snapshot", "old_logit_model"])
def test_async_k2_sigkill_after_checkpoint_resumes_exactly(sevens, tmp_path, source):
    """The exact old-log-prob sources need the weight versions of the restored in-flight samples: the checkpoint
    carries each rank's stored versions (snapshot) and the already-scored log-probs (old_logit_model)."""
    ref_dir, kill_dir = tmp_path / "ref", tmp_path / "killed"
    args = [*sevens, *ASYNC, f"algorithm.old_logp_source={source}"]
    proc = _train([*args, f"run.dir={ref_dir}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    # SIGKILL right after the step-2 checkpoint is durable (rounds 3 and 4 are in flight at that moment)
    proc = _train([*args, f"run.dir={kill_dir}"], env={"MCORE_RL_CRASH_AT": "after_latest:2"})
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert (kill_dir / "checkpoints" / "latest").read_text().strip() == "step_000002"
    proc = _train([*args, f"run.dir={kill_dir}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed 2 round(s) in flight" in proc.stderr
    ref, res = _last_per_step(ref_dir / "metrics.jsonl"), _last_per_step(kill_dir / "metrics.jsonl")
    assert sorted(res) == sorted(ref) == list(range(1, 7))
    diffs = [abs(res[s]["loss"] - ref[s]["loss"]) for s in range(3, 7)]
    print(f"async k=2 resume: max |loss diff| over updates 3-6 = {max(diffs):.3g}; rewards "
          f"{[ref[s]['reward_mean'] for s in range(3, 7)]}")
    assert max(diffs) <= 1e-6, diffs
    for s in range(3, 7):
        assert abs(res[s]["reward_mean"] - ref[s]["reward_mean"]) <= 1e-6
        assert res[s]["staleness_max"] == ref[s]["staleness_max"] == 2.0  # exactly k versions behind
        assert res[s]["stale_groups"] == 0.0
    assert len({round(ref[s]["loss"], 6) for s in range(3, 7)}) > 1  # the losses move: the comparison bites
    assert_trains(list(ref.values()))
    assert_async_lag(list(ref.values()))
    # the same prompts, each once, in the same order: none skipped or repeated across the kill
    ref_p, res_p = _last_per_step(ref_dir / "prompts.jsonl", "update"), _last_per_step(kill_dir / "prompts.jsonl",
                                                                                         "update")
    ref_ids = [i for u in range(1, 7) for i in ref_p[u]["prompt_ids"]]
    res_ids = [i for u in range(1, 7) for i in res_p[u]["prompt_ids"]]
    assert res_ids == ref_ids and len(set(ref_ids)) == len(ref_ids) == 12


def test_async_requeue_trains_the_stale_prompts_later(batch):
    """`stale_policy=requeue` end to end. In one run a consumed round lags exactly k versions, never more (the
    schedule keeps k rounds ahead and bumps the version once per round), so staleness is made the way an operator
    would meet it: a run with k=2 checkpoints at update 2 with rounds 2 and 3 generated at versions 0 and 1, and is
    resumed with `algorithm.max_staleness=1`. At version 2, round 2 lags 2 > 1: its 2 prompts are requeued into the
    next submitted round (4), which lags 1 when consumed and trains at update 4. Data in file order
    (`data.sampler.shuffle=false`): arith-s0-<i> is the i-th prompt. ~35-50 s (two short runs)."""
    (run_dir, first), (_, proc) = batch["requeue_k2"], batch["requeue_k1"]
    assert first.returncode == 0, first.stderr[-4000:]
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed 2 round(s) in flight: 4 request(s) restored finished" in proc.stderr
    assert "round 2: every group was stale" in proc.stderr
    recs = _last_per_step(run_dir / "metrics.jsonl")
    assert sorted(recs) == [1, 2, 3, 4]
    assert [recs[s]["stale_requeued_total"] for s in (1, 2, 3, 4)] == [0.0, 0.0, 2.0, 2.0]  # round 2's 2 groups
    assert all(recs[s]["stale_dropped_total"] == 0.0 for s in recs)
    assert [recs[s]["staleness_max"] for s in (3, 4)] == [1.0, 1.0]  # what trains after the resume is within k=1
    assert_async_lag(list(recs.values()))
    prompts = _last_per_step(run_dir / "prompts.jsonl", "update")
    ids = {u: prompts[u]["prompt_ids"] for u in (1, 2, 3, 4)}
    assert ids[3] == ["arith-s0-6", "arith-s0-7"]  # round 3 (version 1) was fresh enough
    assert ids[4] == ["arith-s0-4", "arith-s0-5"]  # the requeued prompts of round 2, trained one round later
    assert sorted(i for u in ids.values() for i in u) == sorted(f"arith-s0-{i}" for i in range(8))  # none lost


def test_dapo_dynamic_sampling_three_updates(batch):
    run_dir, proc = batch["dapo"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        # about 1 group in 4 has equal rewards on this model: the data allows a full batch within 3 draws
        assert r["zero_variance_groups"] == 0.0, r
        assert 1 <= r["dynamic_sampling_rounds"] <= 3
        # on-policy the loss VALUE can be exactly 0 (ratio 1, equal lengths: token-mean of normalised advantages);
        # its gradient is not
        assert 0 < r["reward_mean"] < 1 and r["grad_norm"] > 0
    assert_trains(recs)
    print("DAPO draws per update:", [r["dynamic_sampling_rounds"] for r in recs])


def _p3o(sevens, run_dir: Path, torchrun: int = 0):
    proc = _train(_p3o_args(sevens, run_dir), torchrun=torchrun)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_p3o_batch_ess_three_updates(batch):
    run_dir, proc = batch["p3o"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    ess = [r["ess_batch"] for r in recs]
    assert ess[0] == pytest.approx(1.0, abs=1e-6)  # the first update is on-policy: every ratio is 1
    assert all(0 < e <= 1 for e in ess) and ess[2] < 1 - 1e-6  # later updates drift off the behaviour policy
    assert all(r["ess_factor"] == pytest.approx(r["ess_batch"], rel=1e-12) for r in recs)  # the loss used it
    assert_trains(recs)
    print("P3O batch ESS per update:", ess)


@pytest.mark.multiproc
@pytest.mark.slow  # ~2 min: two runs, one of them torchrun with 2 ranks
def test_p3o_batch_ess_dp2_equals_single_process(sevens, tmp_path):
    one = _p3o(sevens, tmp_path / "one")
    two = _p3o(sevens, tmp_path / "two", torchrun=2)
    diffs = [abs(a["ess_batch"] - b["ess_batch"]) for a, b in zip(one, two, strict=True)]
    print("P3O batch ESS single vs DP=2:", [a["ess_batch"] for a in one], [b["ess_batch"] for b in two])
    assert max(diffs) <= 1e-5, diffs
