"""`reward=rm placement=server` end to end: the reward client against a real `mcore-rl-serve --is-embedding` over
the real test RM (SmolLM2's trunk under a seeded score head, tests/rewards/rm_fixture.py), with an API key. Each
sample's reward equals HF's own logit of the row the RM's chat template renders, within 1e-4; a row past
max_length is never sent."""

from __future__ import annotations

import pytest

from mcore_rl.rewards import build_reward, step_metrics
from tests.rewards.rm_fixture import hf_scores

pytestmark = pytest.mark.rollout
KEY = "rm-e2e-key"


@pytest.fixture(scope="module")
def rm_server(smollm2_rm_dir, tmp_path_factory):
    from mcore_rl.rollout.sglang.launcher import LauncherConfig, ServerLauncher

    cfg = LauncherConfig(
        model_path=str(smollm2_rm_dir),
        server="mcore-rl-serve",
        api_key=KEY,
        monitor=False,
        health_timeout_s=180,
        extra_args=["--is-embedding", "--num-threads", "1"],
        log_dir=str(tmp_path_factory.mktemp("rm_e2e_logs")),
    )
    with ServerLauncher(cfg) as launcher:
        yield launcher.worker_urls[0]


def test_server_scores_equal_hf_logits_of_the_rendered_rows(rm_server, smollm2_rm_dir, tmp_path):
    from transformers import AutoTokenizer

    key_file = tmp_path / "rm.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    tok = AutoTokenizer.from_pretrained(smollm2_rm_dir)
    prompts = [
        "What is 3 + 4?",
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a prime."}],
        "What is 3 + 4?",
        "Say hi.",
    ]
    responses = ["3 + 4 = 7", "7 is prime.", "It is 8, I think.", "Hello there! " * 40]
    recs = [{"prompt_id": f"p{i}", "prompt": p, "answer": "", "metadata": {}} for i, p in enumerate(prompts)]
    rows = [
        tok.apply_chat_template(
            [
                *([{"role": "user", "content": p}] if isinstance(p, str) else p),
                {"role": "assistant", "content": r},
            ],
            tokenize=True,
            return_dict=False,
        )
        for p, r in zip(prompts, responses)
    ]
    limit = max(len(r) for r in rows[:3])
    assert len(rows[3]) > limit
    fn = build_reward(
        {
            "name": "rm",
            "rm": {
                "path": str(smollm2_rm_dir),
                "placement": "server",
                "urls": [rm_server],
                "api_key_file": str(key_file),
                "max_length": limit,
                "batch_size": 2,
            },
        }
    )
    try:
        res = fn.score(responses, [""] * 4, recs)
        m = step_metrics(fn, res)
    finally:
        fn.close()
    want = hf_scores(smollm2_rm_dir, rows[:3])
    assert [r.reason for r in res] == ["ok", "ok", "ok", "too_long"]
    assert max(abs(r.score - w) for r, w in zip(res, want)) < 1e-4, ([r.score for r in res], want)
    assert min(abs(a - b) for i, a in enumerate(want) for b in want[i + 1 :]) > 1e-3  # the rows really differ
    assert res[3].score == 0.0 and m["reward_rm_too_long"] == 1 and m["reward_rm_requests"] == 2
