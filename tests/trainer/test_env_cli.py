"""`mcore-rl-train model=tiny env=...` through the CLI: multi-turn episodes train under every algorithm and schedule.

The runs use tests/trainer/episode_plugins.py (imported before the CLI's main): calculator's prompts, tool and
limits with a tool-call parser and a judge the random tiny model can trigger, so episodes really take tool turns
(results from the sandboxed pool between model turns) and rewards vary inside a group (real gradient steps).
One run per schedule is in the default suite; the algorithm x schedule grid is marked slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.config.keyscan import REPO

PLUGINS = "import tests.trainer.episode_plugins; from mcore_rl.train import main; main()"
ALGORITHMS = sorted(p.stem for p in (REPO / "hydra_conf" / "algorithm").glob("*.yaml"))
SCHEDULES = ["sync", "staged", "async"]
# every calculator key set through the CLI (the keys-read test checks each is set by some test)
CALC = [
    "env=calculator", "env.name=test_graded_calc", "env.tool_format=test_hash_calls", "env.truncated_turn=close",
    "env.size=16", "env.heldout_size=2", "env.seed=3", "env.max_turns=3", "env.max_total_tokens=600",
    "env.max_new_tokens=8", "env.max_tool_calls_per_turn=2", "env.tool_timeout_s=20", "env.tool_workers=1",
    "env.tool_memory_limit_mb=512", "env.min_operand=1000", "env.max_operand=99999", "env.demonstration=true",
    "env.operations=3",
]  # fmt: skip
SMALL = ["model=tiny", "trainer.prompts_per_update=2", "trainer.samples_per_prompt=4",
         "eval.num_prompts=2", "eval.samples_per_prompt=2", "logging.progress=false", "logging.plot=false",
         "trainer.export_hf=false"]  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": str(REPO)}  # fmt: skip


def _read(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (run_dir / name).read_text().splitlines() if x.strip()]


def train(run_dir: Path, *overrides: str, steps: int = 3) -> tuple[list[dict], list[dict]]:
    """One CLI run; its per-update metrics and its evaluations."""
    cmd = [sys.executable, "-c", PLUGINS, *SMALL, *overrides, f"trainer.steps={steps}", f"run.dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _read(run_dir, "metrics.jsonl"), _read(run_dir, "eval.jsonl")


@pytest.fixture(scope="module")
def schedule_runs(tmp_path_factory) -> dict[str, tuple[list[dict], list[dict]]]:
    """One run per schedule, as one Hydra multirun over `schedule` (one start-up; each job builds and tears down
    its own run, tool pool included), job i in sweep folder i. schedule -> (metrics, evaluations)."""
    sweep = tmp_path_factory.mktemp("schedules")
    cmd = [sys.executable, "-c", PLUGINS, "-m", *SMALL, *CALC, "algorithm=grpo_cpu", f"schedule={','.join(SCHEDULES)}",
           "trainer.steps=3", f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=${hydra.job.num}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = {}
    for i, schedule in enumerate(SCHEDULES):  # job i ran schedule i (Hydra keeps the sweep's order)
        assert f"schedule={schedule}" in (sweep / str(i) / ".hydra" / "overrides.yaml").read_text()
        out[schedule] = _read(sweep / str(i), "metrics.jsonl"), _read(sweep / str(i), "eval.jsonl")
    return out


def check_episodes_trained(metrics: list[dict], evals: list[dict], schedule: str) -> None:
    assert len(metrics) == 3
    assert max(m["env/turns"] for m in metrics) > 1.0  # tool turns happened
    assert (
        max(m["env/tool_calls"] for m in metrics) > 0
        and max(m["env/valid_tool_call_rate"] for m in metrics) > 0
    )
    assert min(m["env/policy_token_frac"] for m in metrics) < 1.0  # tool text in the batch, masked out
    assert max(m["grad_norm"] for m in metrics) > 0.0  # real gradient steps
    assert min(m["zero_variance_groups"] for m in metrics) < 2  # some group kept a non-zero advantage
    for m in metrics:  # rewards are the environment's: success equals the batch's accuracy
        assert m["env/success"] == pytest.approx(m["accuracy"])
    if schedule == "async":
        assert max(m["staleness_max"] for m in metrics) > 0  # episodes trained on older weights
    assert len(evals) == 2 and all("env/valid_tool_call_rate" in e and "env/turns" in e for e in evals)
    assert all(0.0 <= e["mean_at_k"] <= 1.0 and e["num_prompts"] == 2 for e in evals)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_calculator_episodes_train_under_every_schedule(schedule, schedule_runs):
    check_episodes_trained(*schedule_runs[schedule], schedule)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("algorithm", [a for a in ALGORITHMS if a != "grpo_cpu"])
def test_calculator_episodes_train_every_algorithm(algorithm, schedule, tmp_path):
    # one update per round, so three rounds are consumed (async: the later ones on older weights)
    one = "algorithm.updates_per_stage=1" if schedule == "staged" else "algorithm.updates_per_rollout=1"
    metrics, evals = train(tmp_path / "run", *CALC, f"algorithm={algorithm}", f"schedule={schedule}", one)
    check_episodes_trained(metrics, evals, schedule)


def test_retry_env_feedback_turns_through_the_cli(tmp_path):
    """The built-in `retry` environment, every key set: a wrong answer gets the environment's feedback and
    another turn (the tiny model is always wrong: every episode runs out of attempts)."""
    metrics, evals = train(
        tmp_path / "run", "env=retry", "env.size=8", "env.heldout_size=2", "env.seed=1", "env.task=basic_arithmetic",
        "env.task_options.min_terms=2", "env.task_options.max_terms=2", "env.task_options.min_digits=1",
        "env.task_options.max_digits=1", "env.task_options.operators=[+]", "env.max_attempts=2", "env.discount=0.5",
        "env.max_turns=2", "env.max_total_tokens=500", "env.max_new_tokens=6", "env.truncated_turn=close",
        steps=1,
    )  # fmt: skip
    m = metrics[-1]
    assert m["env/turns"] == 2.0 and m["env/end_out_of_attempts"] == 1.0 and m["env/tool_calls"] == 0.0
    assert m["reward_mean"] == 0.0 and m["zero_variance_groups"] == 2.0
    assert evals[-1]["env/turns"] == 2.0
