"""The collective layer across two real ranks under NCCL semantics: values that differ per rank combine correctly,
results come back on the CPU, and the strict collectives saw only device tensors on NCCL groups and host tensors
on the gloo host group (tests/distributed/layer_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_torchrun

pytestmark = pytest.mark.multiproc

WORKER = Path(__file__).with_name("layer_worker.py")


def test_two_ranks_under_nccl_semantics(tmp_path):  # ~30 s: two processes importing Megatron
    run_torchrun(2, WORKER, "--out", str(tmp_path), timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, res in enumerate(ranks):
        assert res["dp"] == 2
        assert res["raw_cpu_all_reduce"] == "No backend type associated with device type cpu"
        assert res["sum"] == [3.0, -3.0] and res["max"] == [2.0, -1.0] and res["min"] == [1.0, -2.0]
        assert res["x_untouched"] == [r + 1.0, -(r + 1.0)]
        assert res["gather"] == [[0.0, 0.0], [10.0, 1.0]]
        assert res["broadcast"] == [1.0, 7.0] and res["floats"] == [1.5]
        assert res["any"] == [True, False] and res["object"] == {"from": 1}
        assert res["dp_reduce"] == [3.0]
        assert res["micro_batches"] == ([16.0, 0.0, 0.0] if r == 0 else [16.0, 16.0, 16.0])  # padded, all-zero mask
        assert res["moe"] == {"moe_load_e0": 0.5, "moe_load_e1": 0.5, "moe_load_max_over_mean": 1.0}
        assert res["timeouts"] == [123.0, 123.0]
        # NCCL groups: device tensors only; the host group: CPU tensors and tensor-less ops only
        assert {(dev, host) for _, dev, host in res["calls"]} <= {("lazy", False), ("cpu", True), ("", True)}
        assert ["all_reduce", "lazy", False] in res["calls"] and ["broadcast_object_list", "", True] in res["calls"]
    assert ranks[1]["received"] == {"payload": [1, 2, 3]}
