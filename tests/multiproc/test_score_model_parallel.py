"""The Megatron reward model at TP=2, PP=2 and DP=2 (gloo, 2 processes) scores as transformers does (fp32, 1e-5).

PP=2 runs the test RM (SmolLM2's 30 layers under a seeded head, tests/rewards/rm_fixture.py); TP=2 a tiny random
Llama classifier (SmolLM2's 9 attention heads do not split over 2 ranks), two logit columns; EP=2 a tiny Qwen3-MoE one. The rows differ in
length and include pad tokens inside a row and at its end; the HF reference is one right-padded batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import run_torchrun
from tests.multiproc.score_rm import hf_padded_scores, make_tiny_rm, sample_rows

pytestmark = pytest.mark.multiproc
WORKER = Path(__file__).with_name("score_worker.py")


def _run(folder: Path, rows: list[list[int]], tmp: Path, *layout: str) -> dict:
    (tmp / "rows.json").write_text(json.dumps(rows))
    run_torchrun(
        2,
        WORKER,
        "--rm",
        str(folder),
        "--rows",
        str(tmp / "rows.json"),
        "--out",
        str(tmp / "out.pt"),
        *layout,
    )
    return torch.load(tmp / "out.pt", weights_only=True)


def test_pp2_test_rm_equals_hf(smollm2_dir, tmp_path):
    from tests.rewards.rm_fixture import make_smollm2_rm

    folder = make_smollm2_rm(tmp_path / "rm")
    pad = json.loads((folder / "config.json").read_text())["pad_token_id"]
    rows = sample_rows(49152, pad)
    got = _run(folder, rows, tmp_path, "--pp", "2")
    ref = hf_padded_scores(folder, rows, pad)
    assert ref.abs().max() > 0.1
    assert (got["scores"] - ref).abs().max().item() < 1e-5
    assert torch.equal(got["label_col"], got["scores"][:, 0])


@pytest.mark.parametrize(
    "layout", [("--tp", "2"), pytest.param(("--tp", "1"), marks=pytest.mark.slow)], ids=["tp2", "dp2"]
)
def test_tiny_rm_layout_equals_hf(layout, tmp_path):
    folder = make_tiny_rm(tmp_path / "rm", num_labels=2)
    rows = sample_rows(512, 0)
    got = _run(folder, rows, tmp_path, *layout, "--budget", "48")
    ref = hf_padded_scores(folder, rows, 0)
    assert (got["scores"] - ref).abs().max().item() < 1e-5


@pytest.mark.slow  # ~15 s; expert parallelism changes only which replica reports
def test_tiny_moe_rm_ep2_equals_hf(tmp_path):
    """EP=2: both data-parallel replicas run every row (the experts' token dispatch spans them); replica 0 reports."""
    folder = make_tiny_rm(tmp_path / "rm", num_labels=2, architecture="qwen3_moe")
    rows = sample_rows(512, 0)
    got = _run(folder, rows, tmp_path, "--ep", "2", "--budget", "48")
    ref = hf_padded_scores(folder, rows, 0)
    assert (got["scores"] - ref).abs().max().item() < 1e-5
