"""`reward=rm reward.rm.placement=trainer` through the CLI: the trainer builds the Megatron reward model
(trainer/reward_service.py) and each logged reward is the RM's score of the sampled responses.

The run is `rm+function` with the function part weighted 0: the function (in the reward worker pool) only writes down
each (prompt, response) it is given, so the test can render them with the RM's own chat template and score them
with transformers (fp32, one row at a time). Per update, the logged `reward_mean` / `reward_std` over the 8 samples
must equal those HF scores' mean / std. Also: the start-up line with the RM's parameter memory, the reward's
description, and the one-line refusals (a non-main thread; a classifier no model family of ours builds).
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

from tests.conftest import run_train_batch
from tests.e2e.sevens import TINY_TASK
from tests.rewards.rm_fixture import hf_scores, make_smollm2_rm

pytestmark = pytest.mark.e2e

COMMON = [
    *TINY_TASK,
    "model.dtype=fp32",
    "eval.num_prompts=0",
    "trainer.prompts_per_update=2",
    "trainer.samples_per_prompt=4",
    "trainer.max_new_tokens=12",
    "trainer.steps=2",
    "logging.progress=false",
    "logging.plot=false",
    "logging.tensorboard=false",
    "trainer.export_hf=false",
]
LOG_FN = """
import fcntl, json

def score(response, answer, record):
    with open({log!r}, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps({{"prompt": record["prompt"], "response": response}}) + "\\n")
    return 0.0
"""


@pytest.fixture(scope="module")
def batch(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("rm_trainer")
    rm = make_smollm2_rm(root / "rm")
    gpt2 = root / "gpt2_rm"  # a classifier the rm reward's own check accepts, which no family of ours builds
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["GPT2ForSequenceClassification"],
                "model_type": "gpt2",
                "id2label": {"0": "LABEL_0"},
            }
        )
    )
    code = root / "code"
    code.mkdir()
    (code / "rm_log_fn.py").write_text(LOG_FN.format(log=str(root / "samples.jsonl")))
    rm_args = ["reward=rm", f"reward.rm.path={rm}", "reward.rm.placement=trainer"]
    runs = [
        [
            *COMMON,
            *rm_args,
            "reward.name=rm+function",
            "+reward.weights.function=0",
            "+reward.function.path=rm_log_fn:score",
            "+reward.function.num_workers=1",
            f"run.dir={root / 'run'}",
        ],
        [*COMMON, "reward=rm", f"reward.rm.path={gpt2}", f"run.dir={root / 'gpt2'}"],
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(code))
        results = run_train_batch(runs, root)
    return root, rm, results


def assert_rewards_are_rm_scores(run_dir, samples_file, rm, first: int = 0) -> None:
    """Update k's logged reward mean and std are those of HF's scores of samples [first + 8k, first + 8k + 8)."""
    from mcore_rl.rewards.reward_model import Renderer

    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(ln) for ln in samples_file.read_text().splitlines()][first : first + 8 * len(recs)]
    assert len(recs) == 2 and len(samples) == 16  # 2 updates x 8 samples, each scored once
    renderer = Renderer(str(rm), "chat")
    ref = torch.tensor(hf_scores(rm, [renderer.render(s["prompt"], s["response"]) for s in samples]))
    for step, rec in enumerate(recs):
        x = ref[8 * step : 8 * (step + 1)]
        assert abs(rec["reward_mean"] - x.mean().item()) < 1e-5, (rec["reward_mean"], x.tolist())
        assert abs(rec["reward_std"] - x.std().item()) < 1e-5, (rec["reward_std"], x.tolist())
    assert ref.std() > 0.01  # the responses really got different scores


def test_logged_reward_is_the_rm_score_of_the_samples(batch):
    root, rm, (res, _) = batch
    assert res.returncode == 0, res.stderr[-4000:]
    assert_rewards_are_rm_scores(root / "run", root / "samples.jsonl", rm)
    assert (
        "reward model rm (LlamaForSequenceClassification, fp32, tp=1 pp=1): 134.5M parameters" in res.stderr
    )
    assert "placement=trainer (Megatron)" in res.stderr


def test_unsupported_rm_architecture_refused_in_one_line(batch):
    _, _, (_, res) = batch
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("config error:")]
    assert len(errors) == 1 and "reward.rm.path=" in errors[0], errors
    assert "GPT2ForSequenceClassification" in errors[0], errors
    assert "LlamaForSequenceClassification" in errors[0], errors  # names what is supported
    # refused before any model was built
    assert "load check" not in res.stderr and "Traceback" not in res.stderr


def test_scoring_from_another_thread_is_refused():
    from mcore_rl.trainer.reward_service import RewardService

    class Model:
        def check_rows(self, rows):
            pass

        def score_ids(self, rows):
            return [1.0] * len(rows)

    scorer = RewardService({"rm": Model()}).scorers()["rm"]
    assert scorer.score_ids([[1, 2]]) == [1.0]  # one process, main thread: just the model
    caught: list[BaseException] = []

    def worker():
        try:
            scorer.score_ids([[1, 2]])
        except RuntimeError as e:
            caught.append(e)

    t = threading.Thread(target=worker, name="episodes_0")
    t.start()
    t.join()
    (err,) = caught
    assert (
        "\n" not in str(err) and "'episodes_0'" in str(err) and "use reward.rm.placement=server" in str(err)
    )


@pytest.mark.multiproc
@pytest.mark.slow  # ~60 s: one torchrun launch of the trainer, with evaluations before and after
def test_tp2_rm_scores_rounds_and_evaluations(tmp_path, smollm2_dir):
    """TP=2 on 2 ranks: rank 0 scores while rank 1 serves the RM's forwards, in both rounds and in the evaluations
    (2 prompts x 2 samples before the first update and after the last), then every rank leaves in step."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO
    from tests.multiproc.score_rm import make_tiny_chat_rm

    rm = make_tiny_chat_rm(tmp_path / "rm", smollm2_dir)
    code = tmp_path / "code"
    code.mkdir()
    (code / "rm_log_fn.py").write_text(LOG_FN.format(log=str(tmp_path / "samples.jsonl")))
    overrides = [o for o in COMMON if not o.startswith("eval.")]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "mcore_rl.train",
        *overrides,
        "parallel.tp=2",
        "eval.num_prompts=2",
        "eval.samples_per_prompt=2",
        "reward=rm",
        f"reward.rm.path={rm}",
        "reward.name=rm+function",
        "+reward.weights.function=0",
        "+reward.function.path=rm_log_fn:score",
        "+reward.function.num_workers=1",
        f"run.dir={tmp_path / 'run'}",
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": os.pathsep.join([str(REPO), str(code)]),
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 4 + 16 + 4, len(lines)  # evaluation, 2 rounds, evaluation
    assert_rewards_are_rm_scores(tmp_path / "run", tmp_path / "samples.jsonl", rm, first=4)
    assert "tp=2 pp=1" in proc.stderr
