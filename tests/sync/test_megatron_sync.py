"""Weight sync from a sharded Megatron policy into the embedded engine: log-probs agree within 1e-4 (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import run_torchrun

pytestmark = [pytest.mark.rollout, pytest.mark.multiproc]
WORKER = Path(__file__).with_name("sync_worker.py")


@pytest.mark.parametrize("nproc,tp,pp,mode", [
    # slow: the TP=2 gather stays in [2-2-1-disk], the tensor transport in [2-1-2-tensor], and both together
    # (TP=2 x PP=2, tensor) in tests/sync/test_serve_sync.py::test_tp2_pp2_sync_into_two_servers[tensor]
    pytest.param(2, 2, 1, "tensor", marks=pytest.mark.slow),
    (2, 1, 2, "tensor"),
    (2, 2, 1, "disk"),
])
def test_engine_matches_policy_after_sync(nproc, tp, pp, mode, tiny_llama_dir, tmp_path):
    out = tmp_path / "res.pt"
    run_torchrun(nproc, WORKER, "--hf", str(tiny_llama_dir), "--tp", str(tp), "--pp", str(pp), "--mode", mode,
                 "--out", str(out))
    res = torch.load(out, weights_only=True)
    assert res["version"] == 7
    assert res["diff_before"] > 1e-2, res  # the trained policy really differs from the engine's initial weights
    assert res["diff"] < 1e-4, res
    assert res["sync_gb"] > 0
