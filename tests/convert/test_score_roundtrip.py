"""mcore-rl-convert carries a reward model's score head both ways: HF `*ForSequenceClassification` -> Megatron
torch_dist checkpoint (the head as `output_layer.weight` [num_labels, hidden]) -> HF folder, bit-exact.

The test RM (SmolLM2 under a seeded one-logit head, tests/rewards/rm_fixture.py) written by 2 pipeline ranks, a tiny
random Qwen2 classifier with two labels by 2 tensor ranks; both in one CLI interpreter (tests/convert/cli_batch.py).
"""

from __future__ import annotations

import json

import pytest

from tests.convert.conftest import assert_same_hf_tensors, run_cli_batch
from tests.multiproc.score_rm import make_tiny_rm
from tests.rewards.rm_fixture import make_smollm2_rm

pytestmark = pytest.mark.convert


def test_score_head_round_trip_is_bit_exact(smollm2_dir, tmp_path):
    from mcore_rl.convert.dist_reader import DistCheckpointReader

    rm = make_smollm2_rm(tmp_path / "rm")
    tiny = make_tiny_rm(tmp_path / "tiny", num_labels=2, architecture="qwen2")
    bad = tmp_path / "qwen2_rm"
    bad.mkdir()
    (bad / "config.json").write_text(
        json.dumps({"architectures": ["Qwen2ForRewardModel"], "model_type": "qwen2"})
    )
    calls = [
        ["hf-to-mcore", "--hf", rm, "--out", tmp_path / "rm_ckpt", "--pp", 2],
        ["mcore-to-hf", "--ckpt", tmp_path / "rm_ckpt", "--out", tmp_path / "rm_back"],
        ["hf-to-mcore", "--hf", tiny, "--out", tmp_path / "tiny_ckpt", "--tp", 2],
        ["mcore-to-hf", "--ckpt", tmp_path / "tiny_ckpt", "--out", tmp_path / "tiny_back"],
        ["verify", "--hf", tiny, "--ckpt", tmp_path / "tiny_ckpt"],
        ["hf-to-mcore", "--hf", bad, "--out", tmp_path / "bad_ckpt"],
    ]
    res = run_cli_batch(calls, tmp_path)
    for r in res[:4]:
        assert r.returncode == 0, (r.args, r.stderr[-2000:])
    for src, name, labels in ((rm, "rm", 1), (tiny, "tiny", 2)):
        shapes = DistCheckpointReader(tmp_path / f"{name}_ckpt").shapes
        hidden = json.loads((src / "config.json").read_text())["hidden_size"]
        assert shapes["output_layer.weight"] == (labels, hidden)  # the score head, not an LM head
        n = assert_same_hf_tensors(src, tmp_path / f"{name}_back")  # torch.equal, same names and dtypes
        assert n > 10
        back = json.loads((tmp_path / f"{name}_back" / "config.json").read_text())
        assert back == json.loads((src / "config.json").read_text())
    for r, what in ((res[4], "is a reward model"), (res[5], "Qwen2ForRewardModel")):
        assert r.returncode == 2 and what in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
