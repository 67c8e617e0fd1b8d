"""`reward=judge` end to end: SmolLM2-135M-Instruct behind a real `mcore-rl-serve` `/v1/chat/completions`, with an API
key, grades (prompt, response, reference) triples. With `yes_no_logprobs` every score is P(yes) / (P(yes) + P(no))
of the first reply token: a number in (0, 1) that differs between triples, equal to the ratio computed from an HF
forward of the same prompt. A setting whose replies cannot be parsed (`boxed` in 4 tokens: `\\boxed{N}` needs 5)
scores 0 with `parse_error`, counted, and the call returns normally."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_rl.rewards import build_reward, step_metrics

pytestmark = pytest.mark.rollout
KEY = "judge-e2e-key"
TRIPLES = [("What is 3 + 4?", "3 + 4 = 7", "7"), ("What is 3 + 4?", "It is 12.", "7"),
           ("What is the capital of France?", "Paris", "Paris"), ("Name a colour.", "The number 42.", "blue")]
TEMPLATE = "Question: {prompt}\nReference: {reference}\nAnswer: {response}\nIs the answer correct? Say yes or no."


@pytest.fixture(scope="module")
def judge_url(smollm2_dir, tmp_path_factory):
    from mcore_rl.rollout.sglang.launcher import LauncherConfig, ServerLauncher

    cfg = LauncherConfig(model_path=str(smollm2_dir), server="mcore-rl-serve", api_key=KEY, monitor=False,
                         health_timeout_s=180, extra_args=["--num-threads", "1"],
                         log_dir=str(tmp_path_factory.mktemp("judge_e2e_logs")))
    with ServerLauncher(cfg) as launcher:
        yield launcher.worker_urls[0]


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "judge.key"
    path.write_text(KEY + "\n")
    path.chmod(0o600)
    return str(path)


def _score(url, key_file, **options):
    fn = build_reward({"name": "judge", "judge": {"url": url, "api_key_file": key_file, "template": TEMPLATE,
                                                  "backoff_s": 0.05, **options}})
    recs = [{"prompt_id": f"p{i}", "prompt": q, "answer": ref, "metadata": {}} for i, (q, _, ref) in enumerate(TRIPLES)]
    try:
        res = fn.score([r for _, r, _ in TRIPLES], [ref for _, _, ref in TRIPLES], recs)
        return fn, res, step_metrics(fn, res)
    finally:
        fn.close()


def _hf_ratio(smollm2_dir, fn, triple) -> float:
    """P(yes) / (P(yes) + P(no)) over the 20 most likely first tokens of an HF forward of the judge's prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    q, r, ref = triple
    text = tok.apply_chat_template(fn.request(q, r, ref)["messages"], tokenize=False, add_generation_prompt=True)
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode(text, add_special_tokens=False)])).logits[0, -1]
    top = torch.log_softmax(logits.float(), -1).topk(20)
    p = {"yes": 0.0, "no": 0.0}
    for lp, i in zip(top.values.tolist(), top.indices.tolist()):
        word = tok.decode([i]).strip().strip(".,!*: ").lower()
        if word in p:
            p[word] += math.exp(lp)
    return p["yes"] / (p["yes"] + p["no"])


def test_smollm2_judge_with_yes_no_logprobs(judge_url, key_file, smollm2_dir):
    fn, res, m = _score(judge_url, key_file, parser="yes_no_logprobs", top_logprobs=20, max_tokens=1)
    scores = [r.score for r in res]
    assert [r.reason for r in res] == ["ok"] * 4, [r.reason for r in res]
    assert all(0.0 < s < 1.0 for s in scores) and max(scores) - min(scores) > 1e-3, scores
    assert scores[0] == pytest.approx(_hf_ratio(smollm2_dir, fn, TRIPLES[0]), abs=1e-4)
    assert m["reward_judge_requests"] == 4 and m["reward_judge_parse_failures"] == 0 and m["reward_judge_errors"] == 0


def test_unparsable_judge_replies_are_counted_not_fatal(judge_url, key_file):
    _, res, m = _score(judge_url, key_file, parser="boxed", max_tokens=4, temperature=0.0)
    assert [(r.score, r.reason) for r in res] == [(0.0, "parse_error")] * 4
    assert m["reward_judge_parse_failures"] == 4 and m["reward_judge_errors"] == 0 and m["reward_judge_requests"] == 4


def test_training_run_on_a_smollm2_judge(judge_url, key_file, tmp_path):
    """The judge as a run's reward through the CLI (the tiny task's policy, SmolLM2 judging every sample): P(yes)
    varies within each group, so every update takes a gradient step; a second judge part whose replies cannot be
    parsed (`boxed` in 4 tokens) scores 0 for every sample, counted per step, and the run finishes."""
    import json

    from tests.conftest import run_train_batch
    from tests.e2e.sevens import TINY_TASK

    run_dir = tmp_path / "judge_run"
    args = [*TINY_TASK, "eval.num_prompts=0", "trainer.prompts_per_update=2", "trainer.samples_per_prompt=4",
            "trainer.max_new_tokens=8", "trainer.steps=2", "logging.progress=false", "logging.plot=false",
            "trainer.export_hf=false", "reward=judge", "reward.name=judge+judge2",
            f"reward.judge.url={judge_url}", f"reward.judge.api_key_file={key_file}",
            "reward.judge.parser=yes_no_logprobs", "reward.judge.top_logprobs=20", "reward.judge.max_tokens=1",
            f"+reward.judge2.url={judge_url}", f"+reward.judge2.api_key_file={key_file}",
            "+reward.judge2.parser=boxed", "+reward.judge2.max_tokens=4", "+reward.weights.judge2=0.5",
            "reward.max_crash_rate=1.0", f"run.dir={run_dir}"]
    (res,) = run_train_batch([args], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 2
    for r in recs:
        assert 0.0 < r["reward/judge"] < 1.0 and r["reward_std"] > 0, r
        assert r["reward_judge_parse_failures"] == 8 and r["reward_judge_errors"] == 0, r
        assert r["grad_norm"] > 0 and r["adv_zero_variance_group_frac"] == 0.0, r
    assert "parse_error" in res.stderr  # the one warning line per step names them
