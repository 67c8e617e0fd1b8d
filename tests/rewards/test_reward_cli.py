"""`reward=function` and `reward=remote` through the CLI on the tiny model's task (tests/e2e/sevens.py), in one
interpreter (tests/train_batch.py): a user function that misbehaves on six of its calls (sleep past the deadline,
raise, allocate without bound, os._exit, NaN, a string) and a reward service that fails once with 500 and answers
one request without `rewards`. Both runs finish, count every failure in metrics.jsonl, name them in one line per
step, and take real gradient steps; an unimportable function stops the run before any model is built (exit 2)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_train_batch
from tests.e2e.sevens import TINY_TASK, assert_trains
from tests.rewards.rm_server import RewardServer

pytestmark = pytest.mark.e2e

COMMON = [*TINY_TASK, "eval.num_prompts=0", "trainer.prompts_per_update=2", "trainer.samples_per_prompt=4",
          "trainer.max_new_tokens=16", "trainer.steps=3", "logging.progress=false", "logging.plot=false",
          "trainer.export_hf=false"]
# call number (1-based, over the whole run: 8 calls a step) -> what the user's function does on it
MISBEHAVE = {3: "sleep", 6: "raise", 9: "alloc", 12: "exit", 15: "nan", 18: "str"}

USER_MODULE = '''
import fcntl, os, re, time

COUNTER = {counter!r}
MISBEHAVE = {misbehave!r}


def _call_number():
    """Calls so far in any worker process (a file grown under a lock): the run misbehaves on exact calls."""
    with open(COUNTER, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write("x")
        f.flush()
        return os.path.getsize(COUNTER)


def score(response, answer, record):
    kind = MISBEHAVE.get(_call_number())
    if kind == "sleep":
        time.sleep(60)
    if kind == "raise":
        raise RuntimeError("a bug in the user's reward")
    if kind == "alloc":
        hog = []
        while True:
            hog.append(bytearray(64 * 2**20))
    if kind == "exit":
        os._exit(5)
    if kind == "nan":
        return float("nan")
    if kind == "str":
        return "full marks"
    numbers = re.findall(r"-?\\d+", response)
    return {{"score": float(bool(numbers) and numbers[-1] == answer), "numbers": float(len(numbers)),
            "a": record["metadata"]["a"]}}
'''


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward_cli")
    code = root / "usercode"
    code.mkdir()
    counter = root / "calls"
    (code / "cli_reward_fn.py").write_text(USER_MODULE.format(counter=str(counter), misbehave=MISBEHAVE))
    key = root / "rm.key"
    key.write_text("cli-test-key\n")
    key.chmod(0o600)
    runs = {
        "function": [*COMMON, "reward=function", "reward.function.path=cli_reward_fn:score",
                     "reward.function.timeout_s=2", "reward.function.memory_limit_mb=256",
                     "reward.function.num_workers=2", f"run.dir={root / 'function'}"],
        "bad_path": [*COMMON, "reward=function", "reward.function=no_such_module_xyz:score",
                     f"run.dir={root / 'bad_path'}"],
    }
    with RewardServer(api_key="cli-test-key", fail_first=1, bad_requests=(6,)) as srv, \
            pytest.MonkeyPatch.context() as mp:
        runs["remote"] = [*COMMON, "reward=remote", f"reward.remote.url={srv.url}", "reward.remote.batch_size=2",
                          "reward.remote.max_concurrency=2", "reward.remote.timeout_s=30",
                          "reward.remote.max_attempts=2", "reward.remote.backoff_s=0.05",
                          f"reward.remote.api_key_file={key}", f"run.dir={root / 'remote'}"]
        mp.setenv("PYTHONPATH", str(code))  # run_train_batch puts the repo in front of it
        results = run_train_batch(list(runs.values()), root)
    out = {name: (root / name, res) for name, res in zip(runs, results)}
    out["server"] = srv
    return out


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_misbehaving_user_function_costs_only_its_samples(batch):
    run_dir, res = batch["function"]
    assert res.returncode == 0, res.stderr[-4000:]
    recs = _records(run_dir)
    assert len(recs) == 3
    total = {k: sum(r[k] for r in recs) for k in ("reward_timeouts", "reward_errors", "reward_memory_limit",
                                                  "reward_crashes", "reward_invalid")}
    assert total == {"reward_timeouts": 1.0, "reward_errors": 1.0, "reward_memory_limit": 1.0,
                     "reward_crashes": 2.0, "reward_invalid": 2.0}  # crashes: the alloc and the os._exit
    assert all(0 <= r["reward/a"] <= 7 and r["reward/numbers"] >= 0 for r in recs)  # the dict's extra keys
    assert_trains(recs)  # rewards vary within groups, grad_norm > 0
    lines = [ln for ln in res.stderr.splitlines() if "reward function cli_reward_fn:score:" in ln]
    assert len(lines) == 3, lines  # one per step that had failures (every step here)
    named = " ".join(lines)
    for kind in ("timeout=1", "error:RuntimeError=1", "memory_limit=1", "worker_crash=1", "invalid:nan=1",
                 "invalid:str=1"):
        assert kind in named, lines
    assert "reward worker pid=" not in res.stderr  # no per-case lines beside the summaries
    assert "reward: function cli_reward_fn:score (per sample; num_workers=2, timeout_s=2 per call" in res.stderr


def test_unimportable_function_stops_before_any_model(batch):
    _, res = batch["bad_path"]
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("config error:")]
    assert errors == ["config error: reward.function.path='no_such_module_xyz:score': cannot import module "
                      "'no_such_module_xyz' (ModuleNotFoundError: No module named 'no_such_module_xyz')"]
    assert "Traceback" not in res.stderr and "load check" not in res.stderr  # no model was built


def test_remote_reward_service_through_the_cli(batch):
    run_dir, res = batch["remote"]
    srv = batch["server"]
    assert res.returncode == 0, res.stderr[-4000:]
    recs = _records(run_dir)
    assert sum(r["reward_remote_retries"] for r in recs) == 1  # the first request's 500
    assert sum(r["reward_remote_failures"] for r in recs) == 2  # the body without `rewards`: its 2 samples
    assert sum(r["reward_remote_requests"] for r in recs) == 12  # 3 steps x 8 samples / batch_size 2
    assert all(r["reward/response_chars"] > 0 for r in recs)  # extra_logs
    assert_trains(recs)
    bodies = srv.bodies
    assert len(bodies) == 13 and all(set(b) == {"query", "prompts", "labels"} for b in bodies)
    assert all(len(b["query"]) == len(b["prompts"]) == len(b["labels"]) == 2 for b in bodies)
    assert all(lab == "7" for b in bodies for lab in b["labels"])
    # the templated prompt (SmolLM2's chat template, special tokens kept), then the response
    assert all(p.startswith("<|im_start|>") and q.startswith(p) and len(q) > len(p)
               for b in bodies for q, p in zip(b["query"], b["prompts"]))
    assert all(h.get("Authorization") == "Bearer cli-test-key" for h in srv.headers)
    assert "cli-test-key" not in res.stderr + res.stdout + (run_dir / "config.yaml").read_text()
    warned = [ln for ln in res.stderr.splitlines() if "remote reward:" in ln]
    assert len(warned) == 1 and "1 of 4 requests failed (malformed=1)" in warned[0], warned
    assert f"reward: remote http://127.0.0.1:{srv.port}/get_reward (OpenRLHF protocol; batch_size=2" in res.stderr
