"""Partial rollouts through the CLI (`partial_rollout.*`, trainer/partial.py) on the tiny model's task, where rewards
vary (tests/e2e/sevens.py), and on `env=calculator` episodes.

What the runs must show: at least half of the trained samples were carried at least once (generated across two or
more rounds), none was lost or trained twice (every id of run.dir/partial.jsonl), a SIGKILL after a checkpoint and
a resume reproduce the uninterrupted run's losses exactly, and `mask_stale` removes exactly the earlier-version
tokens from the loss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.config.keyscan import REPO
from tests.e2e.sevens import TINY_TASK

SEVENS = [*TINY_TASK, "eval.num_prompts=0", "trainer.prompts_per_update=2", "trainer.samples_per_prompt=4",
          "trainer.max_new_tokens=16", "logging.progress=false", "logging.plot=false", "trainer.export_hf=false",
          "optim.lr=1e-3"]  # fmt: skip
PARTIAL = ["partial_rollout.enabled=true", "partial_rollout.chunk_tokens=4", "partial_rollout.over_issue=2",
           "partial_rollout.max_age=2"]  # fmt: skip
PLUGINS = "import tests.trainer.episode_plugins; from mcore_rl.train import main; main()"


def run(
    run_dir: Path, *overrides: str, env: dict | None = None, plugins: bool = False
) -> subprocess.CompletedProcess:
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1",
         "PYTHONPATH": str(REPO), **(env or {})}  # fmt: skip
    head = ["-c", PLUGINS] if plugins else ["-m", "mcore_rl.train"]
    return subprocess.run([sys.executable, *head, *overrides, f"run.dir={run_dir}"], capture_output=True,
                          text=True, timeout=600, env=e, cwd=REPO)  # fmt: skip


def last_per(path: Path, key: str) -> dict[int, dict]:
    """A resumed run appends: the last record of a step / round is the one that stands."""
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        out[rec[key]] = rec
    return out


def check_ids(rounds: dict[int, dict], n_rounds: int) -> tuple[int, int]:
    """Every issued sample trained exactly once or still carried at the end; returns (trained, carried >= once)."""
    assert sorted(rounds) == list(range(1, n_rounds + 1))
    trained = [sid for r in range(1, n_rounds + 1) for sid in rounds[r]["trained"]]
    assert len(trained) == len(set(trained)), "a sample trained twice"
    issued = {gid for r in rounds.values() for gid in r["issued"]}
    assert len(issued) == sum(len(r["issued"]) for r in rounds.values()), "a group id issued twice"
    groups = lambda ids: {s.split("#")[0] for s in ids}  # noqa: E731
    left = rounds[n_rounds]["carried"]
    assert groups(trained) | groups(left) == issued and not groups(trained) & groups(left), "a sample lost"
    born = {gid: r for r, rec in rounds.items() for gid in rec["issued"]}
    for rec in rounds.values():  # the log's own birth rounds agree with when each group was issued
        assert rec["trained_born"] == [born[s.split("#")[0]] for s in rec["trained"]]
    carried = sum(b < r for r, rec in rounds.items() for b in rec["trained_born"])
    return len(trained), carried



def kill_after_step2_checkpoint_and_resume(run_dir: Path, *args: str, plugins: bool = False) -> str:
    """SIGKILL right after the step-2 checkpoint (MCORE_RL_CRASH_AT), then the same command again: it must resume
    and finish. Returns the resumed run's stderr."""
    proc = run(run_dir, *args, env={"MCORE_RL_CRASH_AT": "after_latest:2"}, plugins=plugins)
    assert proc.returncode == -9, proc.stderr[-3000:]
    proc = run(run_dir, *args, plugins=plugins)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr


def check_resumed_ids(ref_dir: Path, kill_dir: Path, n_rounds: int) -> None:
    """The killed-and-resumed run issued, trained and carried the same ids round by round as the uninterrupted one,
    each id trained exactly once, at least half of them carried at least once."""
    ref_ids, res_ids = last_per(ref_dir / "partial.jsonl", "round"), last_per(kill_dir / "partial.jsonl", "round")
    assert res_ids == ref_ids
    trained, carried = check_ids(res_ids, n_rounds)
    assert 2 * carried >= trained

def test_single_turn_carries_half_and_masks_only_stale_tokens(tmp_path):
    """Four rounds of the sevens task, mask_stale on: every later round trains samples begun a round earlier."""
    proc = run(tmp_path / "run", *SEVENS, *PARTIAL, "partial_rollout.mask_stale=true", "trainer.steps=4")
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = list(last_per(tmp_path / "run" / "metrics.jsonl", "step").values())
    trained, carried = check_ids(last_per(tmp_path / "run" / "partial.jsonl", "round"), 4)
    assert trained == 4 * 8 and 2 * carried >= trained, (trained, carried)
    stale = [m["partial/stale_tokens"] for m in metrics]
    assert [m["partial/masked_stale_tokens"] for m in metrics] == stale  # exactly the earlier-version tokens
    assert stale[0] == 0.0 and min(stale[1:]) > 0  # round 1 is all fresh; later rounds finish carried samples
    assert max(m["partial/carried_tokens"] for m in metrics) > 0  # carried mid-sample, tokens kept
    assert (
        max(m["partial/age_max"] for m in metrics) == 1.0 and max(m["staleness_max"] for m in metrics) == 1.0
    )


@pytest.mark.faults
@pytest.mark.slow  # three CLI runs, ~90 s
def test_sigkill_after_checkpoint_resumes_carried_samples_exactly(tmp_path):
    """Kill right after the step-2 checkpoint (two groups carried mid-sample at that moment); the resumed run
    continues their tokens and reproduces every loss and every id of the uninterrupted run."""
    args = [*SEVENS, *PARTIAL, "trainer.steps=6", "trainer.save_every=2", "algorithm.old_logp_source=snapshot",
            "algorithm.old_logp_audit_frac=1.0", "trainer.deterministic=true"]  # fmt: skip
    ref_dir, kill_dir = tmp_path / "ref", tmp_path / "killed"
    proc = run(ref_dir, *args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed = kill_after_step2_checkpoint_and_resume(kill_dir, *args)
    assert "resumed 2 carried group(s) (8 unfinished samples)" in resumed
    ref, res = last_per(ref_dir / "metrics.jsonl", "step"), last_per(kill_dir / "metrics.jsonl", "step")
    assert sorted(ref) == sorted(res) == list(range(1, 7))
    diffs = [abs(res[s]["loss"] - ref[s]["loss"]) for s in range(1, 7)]
    print(
        f"partial rollout resume: max |loss diff| = {max(diffs):.3g}; losses {[ref[s]['loss'] for s in ref]}"
    )
    assert max(diffs) == 0.0, diffs
    assert len({round(ref[s]["loss"], 8) for s in ref}) > 2  # the losses move: the comparison bites
    for s in range(1, 7):
        assert res[s]["partial/carried_tokens"] == ref[s]["partial/carried_tokens"]
        assert res[s]["old_logp_error"] <= 1e-6  # snapshot scores every carried token under its own version
    check_resumed_ids(ref_dir, kill_dir, 6)


@pytest.mark.slow  # one CLI run per source, ~35 s each
@pytest.mark.parametrize("source", ["snapshot", "old_logit_model", "interrupt", "recompute"])
def test_old_logit_sources_score_carried_tokens_at_their_version(tmp_path, source):
    """The audit (algorithm.old_logp_audit_frac=1) compares each source's old log-probs with every token scored
    under its own stored version. Carried tokens of an earlier version are in the batches; the exact sources match
    within 1e-6, recompute (today's weights) does not. interrupt / old_logit_model restart a carried single-turn
    sample that holds earlier-version tokens (one version per turn), so their tokens are counted as restarted."""
    proc = run(tmp_path / "run", *SEVENS, *PARTIAL, "trainer.steps=4", f"algorithm.old_logp_source={source}",
               "algorithm.old_logp_audit_frac=1.0")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = list(last_per(tmp_path / "run" / "metrics.jsonl", "step").values())
    err = max(m["old_logp_error"] for m in metrics)
    print(
        f"{source}: max old_logp_error {err:.3g}, stale token frac "
        f"{[round(m['old_logp_stale_token_frac'], 3) for m in metrics]}"
    )
    assert max(m["old_logp_stale_token_frac"] for m in metrics) > 0  # the audit saw carried, older tokens
    if source == "recompute":
        assert err > 1e-5
    else:
        assert err <= 1e-6
    restarted = sum(m["partial/restarted_tokens"] for m in metrics)
    assert (restarted > 0) == (source in ("interrupt", "old_logit_model")), restarted
    check_ids(last_per(tmp_path / "run" / "partial.jsonl", "round"), 4)


CALC = ["env=calculator", "env.name=test_graded_calc", "env.tool_format=test_hash_calls", "env.truncated_turn=close",
        "env.size=16", "env.heldout_size=2", "env.max_turns=3", "env.max_total_tokens=600", "env.max_new_tokens=8",
        "env.tool_workers=1", "model=tiny", "trainer.prompts_per_update=2", "trainer.samples_per_prompt=4",
        "eval.num_prompts=0", "logging.progress=false", "logging.plot=false", "trainer.export_hf=false"]  # fmt: skip


def test_calculator_episodes_carried_across_rounds(tmp_path):
    """Episodes pause at a turn boundary once they produced chunk_tokens policy tokens in a chunk: with 8-token
    turns and chunk_tokens=8, every chunk is one model turn, so an episode of two or more turns that is not in
    the batch by then is carried with its finished turns (tool results included) and continues next round.
    Under the staged schedule: its memory hooks around training are the wrapped schedule's."""
    proc = run(tmp_path / "run", *CALC, *PARTIAL[:1], "partial_rollout.chunk_tokens=8", "partial_rollout.over_issue=2",
               "schedule=staged", "algorithm.updates_per_stage=1", "trainer.steps=4", plugins=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = list(last_per(tmp_path / "run" / "metrics.jsonl", "step").values())
    trained, carried = check_ids(last_per(tmp_path / "run" / "partial.jsonl", "round"), 4)
    print(
        f"calculator: {carried}/{trained} trained episodes carried at least once; turns "
        f"{[m['env/turns'] for m in metrics]}"
    )
    assert trained == 4 * 8 and 2 * carried >= trained, (trained, carried)
    assert max(m["env/turns"] for m in metrics) > 1.0
    assert max(m["partial/carried_tokens"] for m in metrics) > 0
    assert max(m["partial/stale_tokens"] for m in metrics) > 0  # carried turns trained one version later
    assert max(m["grad_norm"] for m in metrics) > 0.0


@pytest.mark.parametrize("bad, why", [
    (["schedule=async"], "partial_rollout.enabled=true needs algorithm.schedule sync or staged, not 'async'"),
    (["partial_rollout.over_issue=0.5"], "partial_rollout.over_issue=0.5 must be >= 1"),
])  # fmt: skip
def test_bad_partial_settings_are_one_line_config_errors(tmp_path, bad, why):
    proc = run(tmp_path / "run", *SEVENS, "partial_rollout.enabled=true", *bad, "trainer.steps=1")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert why in proc.stderr


@pytest.mark.faults
@pytest.mark.slow  # three CLI runs, ~100 s
def test_calculator_sigkill_resumes_carried_episodes_exactly(tmp_path):
    """Episodes run in waves of turns (one engine call each), so a seeded episode run is deterministic: a kill
    right after the step-2 checkpoint and a resume continue the carried episodes (paused between turns, tool
    results and environment state included) and reproduce every loss and every id."""
    args = [*CALC, "partial_rollout.enabled=true", "partial_rollout.chunk_tokens=8", "trainer.steps=4",
            "trainer.save_every=2", "trainer.deterministic=true", "optim.lr=1e-3"]  # fmt: skip
    ref_dir, kill_dir = tmp_path / "ref", tmp_path / "killed"
    proc = run(ref_dir, *args, plugins=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "carried group(s)" in kill_after_step2_checkpoint_and_resume(kill_dir, *args, plugins=True)
    ref, res = last_per(ref_dir / "metrics.jsonl", "step"), last_per(kill_dir / "metrics.jsonl", "step")
    assert sorted(ref) == sorted(res) == [1, 2, 3, 4]
    diffs = [abs(res[s]["loss"] - ref[s]["loss"]) for s in ref]
    print(f"calculator resume: max |loss diff| = {max(diffs):.3g}; losses {[ref[s]['loss'] for s in ref]}")
    assert max(diffs) == 0.0 and len({ref[s]["loss"] for s in ref}) > 2, diffs
    assert [res[s]["partial/carried_tokens"] for s in res] == [ref[s]["partial/carried_tokens"] for s in ref]
    assert ref[2]["partial/carried_samples"] > 0  # episodes were carried across the kill
    check_resumed_ids(ref_dir, kill_dir, 4)


@pytest.mark.slow  # a long round, stopped, then resumed: ~90 s
def test_stop_signal_inside_a_round_keeps_every_carried_sample(tmp_path):
    """USR1 (Slurm preemption) while round 2 generates: the chunk in flight is aborted and leaves no trace, the
    checkpoint holds the pool as it was before the chunk (carried groups and the prompts issued for round 2), and
    the resumed run trains every issued sample exactly once."""
    import signal
    import time

    args = ["model=tiny", "trainer.steps=3", "trainer.prompts_per_update=2", "trainer.samples_per_prompt=2",
            "trainer.max_new_tokens=1200", "eval.num_prompts=0", "trainer.save_every=0", "trainer.export_hf=false",
            "logging.progress=false", "logging.plot=false", "partial_rollout.enabled=true",
            "partial_rollout.chunk_tokens=0"]  # fmt: skip
    e = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, "-m", "mcore_rl.train", *args, f"run.dir={tmp_path}"], env=e, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    metrics, deadline = tmp_path / "metrics.jsonl", time.monotonic() + 400
    while not (metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.2)
    time.sleep(1.0)  # round 2 is generating
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "stop requested during generation: round 2 aborted (4 groups carried)" in err
    assert len(metrics.read_text().splitlines()) == 1 and (tmp_path / "PREEMPTED").exists()
    done = run(tmp_path, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed 4 carried group(s)" in done.stderr
    trained, _ = check_ids(last_per(tmp_path / "partial.jsonl", "round"), 3)
    assert trained == 3 * 4
