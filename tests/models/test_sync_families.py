"""Weight sync from a TP/PP-sharded policy into the embedded engine for the new families (the sharded biases and
GELU of a custom Llama, YaRN's frequencies and attention factor, a sliding window, a gated shared expert): after one
training step the engine's log-probs equal the policy's within 1e-4 (fp32), through tests/sync/sync_worker.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import run_torchrun
from tests.models.test_train_families import FAMILIES, tiny_folder

pytestmark = [pytest.mark.rollout, pytest.mark.multiproc]
WORKER = Path(__file__).parents[1] / "sync" / "sync_worker.py"
CASES = [
    pytest.param("llama-bias-gelu", 2, 1, id="bias-gelu-tp2"),
    pytest.param("qwen3-yarn", 2, 1, id="yarn-tp2", marks=pytest.mark.slow),
    pytest.param("mistral-window", 1, 2, id="window-pp2", marks=pytest.mark.slow),
    pytest.param("qwen2-moe-dense", 1, 2, id="qwen2moe-pp2", marks=pytest.mark.slow),
    pytest.param("qwen2-window", 1, 2, id="qwen2-window-pp2", marks=pytest.mark.slow),  # global layer numbers
    pytest.param("qwen3-moe-dense", 1, 2, id="qwen3moe-pp2", marks=pytest.mark.slow),
    pytest.param("llama3", 2, 1, id="llama3-tp2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name,tp,pp", CASES)
def test_engine_matches_policy_after_sync(name, tp, pp, tmp_path):
    try:
        hf = tiny_folder(tmp_path / "hf", *FAMILIES[name])
    except FileNotFoundError as e:  # no SmolLM2 tokenizer on this machine
        pytest.skip(str(e))
    out = tmp_path / "res.pt"
    run_torchrun(2, WORKER, "--hf", str(hf), "--tp", str(tp), "--pp", str(pp), "--out", str(out))
    res = torch.load(out, weights_only=True)
    assert res["diff_before"] > 1e-2, res  # the trained policy really differs from the engine's initial weights
    assert res["diff"] < 1e-4, res
