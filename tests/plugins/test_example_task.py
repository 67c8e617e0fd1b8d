"""The worked example of docs/your_task.md (examples/my_task), copied outside the repository as a reader would:
its reward function, data kind and environment behave as the guide says, and both of the guide's commands run
through the CLI (tiny model, one update each, in one interpreter)."""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_train_batch

pytestmark = pytest.mark.e2e
EXAMPLE = REPO / "examples" / "my_task"
TINY = ["model=tiny", "trainer.steps=1", "trainer.prompts_per_update=2", "trainer.samples_per_prompt=2",
        "trainer.max_new_tokens=8", "eval.num_prompts=0", "logging.progress=false", "logging.plot=false",
        "logging.tensorboard=false", "trainer.export_hf=false", "trainer.save_every=0"]


@pytest.fixture(scope="module")
def copied(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reader") / "my_task"
    shutil.copytree(EXAMPLE, root)
    return root


@pytest.fixture
def my_task(copied, monkeypatch):
    monkeypatch.syspath_prepend(str(copied))
    for name in [m for m in sys.modules if m == "my_task" or m.startswith("my_task.")]:
        monkeypatch.delitem(sys.modules, name)
    return importlib.import_module("my_task")


def test_reward_function_scores_the_last_number(my_task):
    from my_task.rewards import score

    assert score("5 + 7 = 12, so the answer is 12", "12", {})["score"] == 1.0
    assert score("12 apples, then 3 more", "12", {})["score"] == 0.0  # the last number counts
    assert score("12", "12", {}) == {"score": 1.0, "has_number": 1.0, "words": 1.0}
    assert score("no idea", "4", {})["score"] == 0.0


def test_data_kind_and_environment(my_task):
    from mcore_rl.data.registry import build_dataset
    from mcore_rl.envs import build_environment
    from mcore_rl.envs.base import Episode

    importlib.import_module("my_task.envs")
    ds = build_dataset({"kind": "apples", "size": 16, "seed": 3})
    assert len(ds) == 16 and all(str(int(r.answer)) == r.answer for r in ds)
    env = build_environment({"name": "second_chance", "size": 8, "heldout_size": 8})
    train, held = env.records("train"), env.records("heldout")
    from my_task.envs import question

    assert len(held) == 8 and {question(r) for r in train}.isdisjoint({question(r) for r in held})
    rec = train[0]
    ep = Episode(rec, 0, [], turn=1, attempts=1)
    wrong = env.respond(ep, "I think it is -1")
    assert not wrong.done and wrong.reward == 0.0 and rec.answer not in wrong.messages[0]["content"]
    ep.attempts = 2
    right = env.respond(ep, f"Sorry, it is {rec.answer}")
    assert right.done and right.correct and right.reward == 0.5


def test_guide_commands_run(copied, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(copied))
    search = f"hydra.searchpath=[file://{copied / 'conf'}]"
    runs = [[*TINY, search, "plugins=[my_task.data]", "data=apples", "reward=function",
             "reward.function.path=my_task.rewards:score", f"run.dir={tmp_path / 'single'}"],
            [*TINY, search, "plugins=[my_task.envs]", "env=second_chance", f"run.dir={tmp_path / 'env'}"]]
    results = run_train_batch(runs, tmp_path)
    for res in results:
        assert res.returncode == 0, res.stderr[-3000:]
    single = [json.loads(x) for x in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    assert "reward/words" in single[-1] and single[-1]["reward_crashes"] == 0
    assert "plugins: my_task.data (data.kind: apples)" in results[0].stderr
    episodes = [json.loads(x) for x in (tmp_path / "env" / "metrics.jsonl").read_text().splitlines()]
    assert episodes[-1]["step"] == 1
