"""`reward=rm` (placement=server) and `reward=judge` through the CLI on the tiny model's task (tests/e2e/sevens.py),
in one interpreter (tests/train_batch.py), against stand-in servers (tests/rewards/stand_in.py): every rm and judge
key set on the command line, the rows and requests the trainer sends checked, the counters in metrics.jsonl, real
gradient steps; a bad rm setting stops the run before any model is built (exit 2, one line)."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import run_train_batch
from tests.e2e.sevens import TINY_TASK
from tests.rewards.stand_in import StandIn

pytestmark = pytest.mark.e2e

COMMON = [
    *TINY_TASK,
    "eval.num_prompts=0",
    "trainer.prompts_per_update=2",
    "trainer.samples_per_prompt=4",
    "trainer.max_new_tokens=12",
    "trainer.steps=2",
    "logging.progress=false",
    "logging.plot=false",
    "trainer.export_hf=false",
]
IM_END = 2  # SmolLM2's <|im_end|>: what ends the assistant turn of every rendered RM row


def _rm_logits(ids: list[int]) -> list[float]:
    """Two logits; the run scores column 1: a number from the row, so samples of one prompt differ."""
    return [0.0, float(len(ids) % 5) + 0.1 * (sum(ids) % 3)]


def _judge_chat(body: dict) -> tuple[str, list[tuple[str, float]]]:
    text = body["messages"][-1]["content"]
    if body["model"] == "judge-a":  # yes_no_logprobs: P(yes) from whether the response has a 7
        p = 0.8 if "7" in text.split("R:")[0] else 0.3
        return "Yes", [("Yes", math.log(p)), ("No", math.log(1 - p))]
    return f"I give it {len(text) % 11} points", []  # judge2: parser=number over [0, 10]


@pytest.fixture(scope="module")
def batch(tmp_path_factory, rm_dir):
    root = tmp_path_factory.mktemp("rm_judge_cli")
    key = root / "svc.key"
    key.write_text("svc-test-key\n")
    key.chmod(0o600)
    with (
        StandIn(classify=_rm_logits, api_key="svc-test-key") as rm_srv,
        StandIn(chat=_judge_chat, api_key="svc-test-key", fail_first=1) as judge_srv,
    ):
        runs = {
            "rm": [
                *COMMON,
                "reward=rm",
                f"reward.rm.path={rm_dir}",
                "reward.rm.placement=server",
                f"reward.rm.urls=[{rm_srv.url}]",
                "reward.rm.label=1",
                "reward.rm.template=chat",
                "reward.rm.max_length=512",
                "reward.rm.normalize=group",
                "reward.rm.batch_size=3",
                "reward.rm.max_concurrency=2",
                "reward.rm.timeout_s=30",
                "reward.rm.max_attempts=2",
                "reward.rm.backoff_s=0.05",
                f"reward.rm.api_key_file={key}",
                f"run.dir={root / 'rm'}",
            ],
            "judge": [
                *COMMON,
                "reward=judge",
                "reward.name=judge+judge2",
                "+reward.weights.judge2=0.5",
                f"reward.judge.url={judge_srv.url}",
                "reward.judge.model=judge-a",
                f"reward.judge.api_key_file={key}",
                "reward.judge.system='Grade strictly.'",
                "reward.judge.template='Q: {prompt} R: {response} A: {reference}'",
                "reward.judge.parser=yes_no_logprobs",
                "reward.judge.top_logprobs=2",
                "reward.judge.min_score=0",
                "reward.judge.max_score=1",
                "reward.judge.max_tokens=1",
                "reward.judge.temperature=0",
                "reward.judge.max_concurrency=3",
                "reward.judge.timeout_s=30",
                "reward.judge.max_attempts=2",
                "reward.judge.backoff_s=0.05",
                f"+reward.judge2.url={judge_srv.url}/v1",
                "+reward.judge2.parser=number",
                "+reward.judge2.template='{response}'",
                f"+reward.judge2.api_key_file={key}",
                f"run.dir={root / 'judge'}",
            ],
            "bad": [
                *COMMON,
                "reward=rm",
                f"reward.rm.path={rm_dir}",
                "reward.rm.placement=server",
                "reward.rm.urls=[]",
                f"run.dir={root / 'bad'}",
            ],
        }
        results = run_train_batch(list(runs.values()), root)
    return {name: (root / name, res) for name, res in zip(runs, results)} | {
        "rm_srv": rm_srv,
        "judge_srv": judge_srv,
    }


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_rm_placement_server_through_the_cli(batch, rm_dir):
    run_dir, res = batch["rm"]
    srv = batch["rm_srv"]
    assert res.returncode == 0, res.stderr[-4000:]
    recs = _records(run_dir)
    assert len(recs) == 2
    rows = [r for b in srv.bodies("/classify") for r in b["input_ids"]]
    assert len(rows) == 16 and all(set(b) == {"input_ids"} for b in srv.bodies("/classify"))
    assert [len(b["input_ids"]) for b in srv.bodies("/classify")] == [3, 3, 2] * 2  # batch_size=3, 8 a step
    assert all(
        r[0] == 1 and IM_END in r[-2:] for r in rows
    )  # <|im_start|> ... <|im_end|>\n: the RM's template
    assert sum(r["reward_rm_requests"] for r in recs) == 6 and sum(r["reward_rm_failures"] for r in recs) == 0
    assert all(abs(r["reward_mean"]) < 1e-6 for r in recs)  # normalize=group: each prompt's scores z-scored
    assert all(0 <= r["reward/rm_score"] < 5.3 for r in recs)  # the raw logit of column 1
    assert any(r["grad_norm"] > 0 for r in recs)
    assert all(h.get("Authorization") == "Bearer svc-test-key" for _, _, h in srv.requests)
    assert "svc-test-key" not in res.stderr + res.stdout + (run_dir / "config.yaml").read_text()
    assert (
        f"reward: rm {rm_dir} (placement=server http://127.0.0.1:{srv.port}; label=1, template=chat, max_length=512, "
        "normalize=group, batch_size=3" in res.stderr
    )


def test_judge_and_a_second_judge_through_the_cli(batch):
    run_dir, res = batch["judge"]
    srv = batch["judge_srv"]
    assert res.returncode == 0, res.stderr[-4000:]
    recs = _records(run_dir)
    first = [b for b in srv.bodies("/v1/chat/completions") if b["model"] == "judge-a"]
    second = [b for b in srv.bodies("/v1/chat/completions") if b["model"] == "default"]
    assert first and second and len(first) + len(second) == len(srv.requests)
    assert all(b["messages"][0] == {"role": "system", "content": "Grade strictly."} for b in first)
    assert all(
        b["messages"][1]["content"].startswith("Q: ") and " A: 7" in b["messages"][1]["content"]
        for b in first
    )
    assert all(b["logprobs"] is True and b["top_logprobs"] == 2 and b["max_tokens"] == 1 for b in first)
    assert all("logprobs" not in b and b["max_tokens"] == 16 for b in second)
    assert sum(r["reward_judge_retries"] for r in recs) == 1  # the stand-in's first answer was a 500
    assert (
        sum(r["reward_judge_requests"] for r in recs) + sum(r["reward_judge_cache_hits"] for r in recs) == 32
    )
    assert sum(r["reward_judge_parse_failures"] + r["reward_judge_errors"] for r in recs) == 0
    assert all(0 < r["reward/judge"] < 1 and 0 <= r["reward/judge2"] <= 1 for r in recs)  # per-part means
    assert any(r["grad_norm"] > 0 for r in recs)
    assert "svc-test-key" not in res.stderr + res.stdout
    assert (
        f"reward: 1 * judge: judge http://127.0.0.1:{srv.port}/v1/chat/completions (model=judge-a, "
        "parser=yes_no_logprobs, top_logprobs=2" in res.stderr
    )
    assert "+ 0.5 * judge2: judge" in res.stderr and "parser=number [0, 10] -> [0, 1]" in res.stderr


def test_bad_rm_setting_stops_before_any_model(batch):
    _, res = batch["bad"]
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("config error:")]
    assert errors == [
        "config error: reward.rm.placement=server needs reward.rm.urls=[http://host:port,...] (the RM servers "
        "themselves: sglang-router does not forward /classify)"
    ]
    assert "Traceback" not in res.stderr
