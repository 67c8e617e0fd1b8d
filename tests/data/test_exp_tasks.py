"""The experiments' tasks (hydra_conf/data/{addsub,sum3}.yaml, experiments/README.md): each held-out split (the
trainer's default: seed + 1000, first eval.num_prompts items) shares no question with its training split; the
experiments' task (addsub) trains and evaluates through the CLI, and the per-prompt correctness the experiments
bootstrap over is written per eval."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mcore_rl.data import build_dataset
from tests.evaluation.conftest import read_jsonl, run_module

TASK = "addsub"  # experiments/common.TASK_OVERRIDES
DATA = Path(__file__).resolve().parents[2] / "hydra_conf" / "data"


def _questions(spec: dict) -> list[str]:
    return [r.prompt[0]["content"] for r in build_dataset(spec)]


def _spec(task: str = TASK, **changes) -> dict:
    spec = OmegaConf.to_container(OmegaConf.load(DATA / f"{task}.yaml"), resolve=True)
    spec.pop("sampler")
    return {**spec, **changes}


@pytest.mark.parametrize("task", ["addsub", "sum3"])
def test_heldout_split_is_disjoint_from_training(task):
    train = _spec(task)
    held = _spec(
        task,
        seed=train["seed"] + 1000, size=train["exclude"]["size"]
    )  # what PromptSource._eval_spec derives
    assert train["exclude"]["seed"] == held["seed"]
    tq, hq = _questions(train), _questions(held)
    assert len(hq) == held["size"]  # the held-out split is never thinned: it is the one excluded
    assert not set(tq) & set(hq)
    # without the exclusion the splits would share questions (seeds alone do not separate them)
    assert set(_questions(_spec(task, exclude=None))) & set(hq)
    assert len(tq) >= 0.7 * train["size"]  # a small problem space: the exclusion costs some training items


def test_exclude_bad_input_names_the_field():
    with pytest.raises(ValueError, match=r"data\.exclude: expected"):
        build_dataset(_spec(exclude={"seed": 1000}))
    with pytest.raises(ValueError, match=r"data\.exclude: expected"):
        build_dataset(_spec(exclude={"seed": 1000, "size": 0}))


def test_task_trains_and_evaluates_through_the_cli(tmp_path):
    """One update of the tiny model on the task; the eval record and its per-prompt correctness agree."""
    run_dir = tmp_path / "run"
    proc = run_module(
        "mcore_rl.train",
        "model=tiny",
        "model.dtype=fp32",
        f"data={TASK}",
        "trainer.steps=1",
        "trainer.prompts_per_update=2",
        "trainer.samples_per_prompt=2",
        "trainer.max_new_tokens=8",
        "eval.num_prompts=5",
        "eval.samples_per_prompt=4",
        "eval.max_new_tokens=8",
        "eval.temperature=1.0",
        "trainer.export_hf=false",
        "trainer.save_every=0",
        "logging.progress=false",
        "logging.plot=false",
        "logging.tensorboard=false",
        "data.exclude.seed=1000",
        "data.exclude.size=64",  # the yaml says 300; 64 excludes fewer training questions
        f"run.dir={run_dir}",
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    kept = len(_questions(_spec(exclude={"seed": 1000, "size": 64})))
    assert 0.9 * 1024 < kept < 1024  # the 64 held-out questions that also occur among training's 1024 are dropped
    skipped = 1024 - kept
    assert f"loaded {kept}/1024 rows; skipped {skipped} (in_excluded_split={skipped})" in proc.stdout + proc.stderr
    prompts = read_jsonl(run_dir / "prompts.jsonl")
    assert prompts and all(
        pid.startswith("rg-") and "-s0-" in pid for r in prompts for pid in r["prompt_ids"]
    )
    evals, per_prompt = read_jsonl(run_dir / "eval.jsonl"), read_jsonl(run_dir / "eval_prompts.jsonl")
    assert [r["step"] for r in evals] == [r["step"] for r in per_prompt] == [0, 1]
    for rec, pp in zip(evals, per_prompt):
        fracs = pp["per_prompt_correct"]
        assert len(fracs) == 5 and all(f in (0.0, 0.25, 0.5, 0.75, 1.0) for f in fracs)
        assert sum(fracs) / 5 == pytest.approx(rec["mean_at_k"])
    json.dumps(per_prompt)  # plain JSON: what experiments/common.collect copies into data/
