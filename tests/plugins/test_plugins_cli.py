"""A user's plugin package (tests/plugins/package.py, written outside the repository and found through PYTHONPATH and
`hydra.searchpath`) through the commands a user runs: `mcore-rl-train` sync and async, a Hydra multirun, the plugin
list in a yaml, `module:attr` names, `mcore-rl-eval` on the run, torchrun TP=2 (every rank imports the plugins).
`sbatch slurm/train.sbatch` with a plugin is in tests/slurm/test_plugins_sbatch.py.

The training runs share one interpreter (run_train_batch) with MCORE_RL_PLUGINS=guesspkg.envs set once for all,
as a user would; the tiny model's task (answers are 7) makes rewards vary, so every run takes real gradient steps.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_train_batch
from tests.e2e.sevens import assert_async_lag
from tests.plugins.package import markers, plugin_env, write_package

pytestmark = pytest.mark.e2e

SMALL = ["model=tiny_sevens", "trainer.prompts_per_update=4", "trainer.samples_per_prompt=4",
         "trainer.max_new_tokens=16", "eval.num_prompts=0", "logging.progress=false", "logging.plot=false",
         "logging.tensorboard=false"]  # fmt: skip


def _read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _parameters(stderr: str) -> list[tuple[int, int, str]]:
    """(trainable, total, LoRA note) of every start-up `parameters:` line."""
    found = re.findall(r"\] parameters: ([\d,]+) of ([\d,]+) train \([\d.]+%(.*)\)", stderr)
    return [(int(a.replace(",", "")), int(b.replace(",", "")), note) for a, b, note in found]


def assert_trained(recs: list[dict]) -> None:
    """Rewards varied (neither all 0 nor all 1 over the run) and some update took a real gradient step."""
    assert max(r["grad_norm"] for r in recs) > 0, [r["grad_norm"] for r in recs]
    assert 0 < sum(r["reward_mean"] for r in recs) < len(recs), [r["reward_mean"] for r in recs]


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> dict[str, Path]:
    """The user's folder (outside the repository) holding guesspkg, its conf folder and a markers folder."""
    root = tmp_path_factory.mktemp("user_code")
    conf = write_package(root)
    (root / "markers").mkdir()
    return {"root": root, "conf": conf, "markers": root / "markers", "runs": tmp_path_factory.mktemp("runs")}


def _runs(user: dict[str, Path]) -> dict[str, list[str]]:
    conf, runs = user["conf"], user["runs"]
    search = f"hydra.searchpath=[file://{conf}]"
    return {  # the multirun first: its plugins are imported only because its yaml lists them
        # the list in the user's own primary config, whose algorithm yaml names no schema; module:attr names for a
        # data kind and a reward function (run in the sandboxed workers), two jobs of a multirun; LoRA
        "multirun": ["-m", "--config-dir", str(conf), "--config-name", "guess_job", *SMALL, "trainer.steps=2",
                     "model.lora.rank=4",
                     "trainer.export_hf=false", "data.kind=guesspkg.data:load_words", "reward=function",
                     "reward.function=guesspkg.rewards:score", "seed=1,2", f"hydra.sweep.dir={runs / 'multirun'}",
                     "hydra.sweep.subdir=${hydra.job.num}"],
        # plugin data kind, reward and algorithm (its yaml names its schema: stored before Hydra composed)
        "sync": [*SMALL, search, "plugins=[guesspkg.data,guesspkg.rewards,guesspkg.algos]", "data=words",
                 "reward=has_seven", "algorithm=grpo_plugin", "algorithm.greeting=hi", "trainer.steps=3",
                 "trainer.export_hf=false", f"run.dir={runs / 'sync'}"],
        # the plugin environment, from MCORE_RL_PLUGINS alone; its hf/ export is evaluated below
        "async": [*SMALL, search, "env=guess", "schedule=async", "algorithm.max_staleness=1", "trainer.steps=3",
                  f"run.dir={runs / 'async'}"],
        "broken": [*SMALL, "plugins=[guesspkg.data,guesspkg.broken]"],
        "unknown_env": [*SMALL, search, "env=guess", "env.name=gess"],
        "bad_attr": [*SMALL, search, "env=guess", "env.name=guesspkg.envs:GessEnv"],
        "not_a_loader": [*SMALL, "data.kind=guesspkg.questions:question"],
    }


@pytest.fixture(scope="module")
def batch(user, tmp_path_factory) -> dict:
    """name -> result of every CLI run above, in one interpreter."""
    runs = _runs(user)
    env = {**plugin_env(user["root"], user["markers"]), "MCORE_RL_PLUGINS": "guesspkg.envs"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        results = run_train_batch(list(runs.values()), tmp_path_factory.mktemp("batch"))
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return dict(zip(runs, results))


def test_sync_run_trains_with_plugin_data_reward_and_algorithm(batch, user):
    res = batch["sync"]
    assert res.returncode == 0, res.stderr[-4000:]
    run = user["runs"] / "sync"
    assert_trained(_read(run / "metrics.jsonl"))
    line = next(ln for ln in res.stderr.splitlines() if "] plugins: " in ln)
    assert line.split("] ", 1)[1].startswith("plugins: guesspkg.data (data.kind: words")  # + the multirun's name
    assert line.endswith("guesspkg.rewards (reward.name: has_seven), guesspkg.algos (algorithm.name: "
                         "grpo_plugin), guesspkg.envs (env: guess)")
    ((trainable, total, lora),) = _parameters(res.stderr)
    assert trainable == total > 3_000_000 and lora == ""
    record = (run / "config.yaml").read_text()
    assert "greeting: hi" in record and "name: grpo_plugin" in record and "kind: words" in record
    # the run records every plugin it loaded, MCORE_RL_PLUGINS' included (mcore-rl-eval reads them there)
    assert "plugins:\n- guesspkg.data\n- guesspkg.rewards\n- guesspkg.algos\n- guesspkg.envs\n" in record


def test_async_run_trains_in_a_plugin_environment(batch, user):
    res = batch["async"]
    assert res.returncode == 0, res.stderr[-4000:]
    recs = _read(user["runs"] / "async" / "metrics.jsonl")
    assert_trained(recs)
    assert_async_lag(recs)
    assert max(r["env/turns"] for r in recs) == 1.0  # episodes of the plugin's single-turn environment


def test_multirun_with_the_plugin_list_in_a_yaml_and_module_attr_names(batch, user):
    res = batch["multirun"]
    assert res.returncode == 0, res.stderr[-4000:]
    for job in ("0", "1"):
        run = user["runs"] / "multirun" / job
        assert_trained(_read(run / "metrics.jsonl"))
        record = (run / "config.yaml").read_text()
        assert "greeting: from-yaml" in record and "kind: guesspkg.data:load_words" in record
    assert res.stderr.count("plugins: guesspkg.data (data.kind: words, guesspkg.data:load_words), guesspkg.algos "
                            "(algorithm.name: grpo_plugin), guesspkg.envs (env: guess)") == 2
    counts = _parameters(res.stderr)
    assert len(counts) == 2 and counts[0][0] < counts[0][1] and counts[0][2] == ", LoRA rank 4"
    # the reward function ran in worker processes, which imported the plugin's module themselves (the trainer is
    # the one process that imported guesspkg.algos)
    assert set(markers(user["markers"], "guesspkg.rewards")) - set(markers(user["markers"], "guesspkg.algos"))


def test_a_plugin_that_fails_to_import_is_one_line_exit_2(batch):
    res = batch["broken"]
    assert res.returncode == 2
    assert res.stderr.strip() == ("config error: plugin guesspkg.broken: import failed: RuntimeError: "
                                  "guesspkg.broken cannot start: no licence")


def test_unknown_names_list_builtin_and_plugin_names(batch):
    assert batch["unknown_env"].returncode == 2
    assert batch["unknown_env"].stderr.strip().endswith(
        "config error: env='gess': expected one of calculator, retry; from plugins: guess (guesspkg.envs)")
    assert batch["bad_attr"].returncode == 2
    assert batch["bad_attr"].stderr.strip().endswith(
        "config error: env='guesspkg.envs:GessEnv': module guesspkg.envs has no attribute GessEnv")
    assert batch["not_a_loader"].returncode == 2
    assert batch["not_a_loader"].stderr.strip().endswith(
        "config error: data.kind='guesspkg.questions:question': not a loader registered with @register_dataset")


@pytest.mark.evaluation
def test_eval_on_the_run_loads_its_plugins(batch, user, tmp_path):
    """mcore-rl-eval on the async run dir, without MCORE_RL_PLUGINS: the run's config.yaml names guesspkg.envs;
    --plugin adds the data kind for a --set given as the plugin's data yaml."""
    assert batch["async"].returncode == 0
    out = tmp_path / "eval.jsonl"
    env = {**os.environ, **plugin_env(user["root"], user["markers"]), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("MCORE_RL_PLUGINS", None)
    cmd = [sys.executable, "-m", "mcore_rl.evaluation.cli", str(user["runs"] / "async"), "--env",
           "guess:max_new_tokens=8", "--set", f"{user['conf'] / 'data' / 'words.yaml'}:size=4", "--plugin",
           "guesspkg.data", "--num-prompts", "4", "-n", "2", "--max-new-tokens", "8", "--no-progress", "--out",
           str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _read(out)
    assert [r.get("env") or r.get("set") for r in rows] == [f"{user['conf'] / 'data' / 'words.yaml'}:size=4",
                                                             "guess:max_new_tokens=8"]
    assert all(r["num_prompts"] == 4 for r in rows)
    bad = subprocess.run([*cmd[:4], "--env", "guess", "--plugin", "guesspkg.broken"], capture_output=True,
                         text=True, timeout=120, env=env, cwd=REPO)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == ("mcore-rl-eval: error: plugin guesspkg.broken: import failed: "
                                                   "RuntimeError: guesspkg.broken cannot start: no licence")


@pytest.mark.multiproc
def test_torchrun_tp2_every_rank_imports_the_plugins(batch, user, tmp_path):
    markers_dir = tmp_path / "markers"
    markers_dir.mkdir()
    env = {**os.environ, **plugin_env(user["root"], markers_dir), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    env.pop("MCORE_RL_PLUGINS", None)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "mcore_rl.train", *SMALL, "parallel=tp2", f"hydra.searchpath=[file://{user['conf']}]",
           "plugins=[guesspkg.envs]", "env=guess", "trainer.steps=2", "trainer.export_hf=false", f"run.dir={run}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(markers(markers_dir, "guesspkg.envs").values()) == ["0", "1"]
    assert_trained(_read(run / "metrics.jsonl"))
    assert proc.stderr.count("plugins: guesspkg.envs (env: guess)") == 1  # rank 0 only
    # the whole model's count: each TP shard once, replicated tensors once (as the single-process run counts)
    assert _parameters(proc.stderr) == _parameters(batch["sync"].stderr)
