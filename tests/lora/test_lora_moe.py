"""LoRA on MoE experts (SequentialMLP): EP=2 reproduces EP=1 (log-probs, adapter grad norm, the step, the gathered
adapters); a dist checkpoint of the adapters + optimizer resumes exactly; the merged-weight sync gives the embedded
engine (transformers' Qwen3-MoE) the adapted experts; base weights stay bitwise frozen."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import run_torchrun
from tests.convert.conftest import qwen3_moe_config, save_random_model

pytestmark = pytest.mark.multiproc
WORKER = Path(__file__).with_name("lora_moe_worker.py")


@pytest.fixture(scope="module")
def moe_hf(tmp_path_factory):
    return save_random_model(tmp_path_factory.mktemp("lora_moe_hf"), qwen3_moe_config(), seed=5)


def _run(nproc: int, ep: int, hf: Path, folder: Path, *extra: str) -> dict:
    out = folder / f"ep{ep}.pt"
    args = ["--hf", str(hf), "--ep", str(ep), "--ckpt", str(folder / f"ckpt{ep}"), "--out", str(out), *extra]
    run_torchrun(nproc, WORKER, *args)
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def reference(moe_hf, tmp_path_factory):
    return _run(1, 1, moe_hf, tmp_path_factory.mktemp("lora_moe_ep1"))


@pytest.fixture(scope="module")
def ep2(moe_hf, tmp_path_factory):
    return _run(2, 2, moe_hf, tmp_path_factory.mktemp("lora_moe_ep2"))


@pytest.fixture(scope="module")
def ep2_distopt(moe_hf, tmp_path_factory):
    """EP=2 with the distributed optimizer: dense adapters sharded over DP=2, expert adapters over expert-DP=1."""
    return _run(2, 2, moe_hf, tmp_path_factory.mktemp("lora_moe_ep2_distopt"), "--distributed-optimizer")


def _expert_names(res: dict) -> list[str]:
    return [n for n in res["adapters"] if ".experts.local_experts." in n]


@pytest.mark.parametrize("which", ["ep1", "ep2", pytest.param("ep2_distopt", marks=pytest.mark.slow)])
def test_resume_sync_and_frozen_base(which, request):
    res = request.getfixturevalue({"ep1": "reference"}.get(which, which))
    # 4 layers x 8 experts x (fc1, fc2) x (A, B), full and canonically named on rank 0
    assert len(_expert_names(res)) == 4 * 8 * 2 * 2
    assert res["frozen_same"]
    assert (res["straight"] - res["after"]).abs().max().item() > 1e-3  # step 2 moved the policy
    assert torch.equal(res["reloaded"], res["after"])  # the checkpoint holds the step-1 adapters exactly
    assert torch.equal(res["resumed"], res["straight"])  # ... and the optimizer state: step 2 is the same
    mask = (res["before"] != 0).float()
    assert ((res["engine_before"] - res["resumed"]) * mask).abs().max().item() > 1e-2  # the adapters matter
    assert ((res["engine_after"] - res["resumed"]) * mask).abs().max().item() < 1e-4


@pytest.mark.parametrize("which", ["ep2", pytest.param("ep2_distopt", marks=pytest.mark.slow)])
def test_ep2_matches_ep1(which, reference, request):
    ref, got = reference, request.getfixturevalue(which)
    assert ref["grad_norm"] > 0.01
    assert (ref["after"] - ref["before"]).abs().max().item() > 1e-3
    assert (got["before"] - ref["before"]).abs().max().item() < 1e-5
    assert abs(got["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"] < 1e-5
    assert (got["after"] - ref["after"]).abs().max().item() < 1e-4
    assert got["adapters"].keys() == ref["adapters"].keys()
    for name, t in ref["adapters"].items():
        assert (got["adapters"][name] - t).abs().max().item() < 1e-5, name
    # the routed experts' adapters trained: every expert's B left its fixed start value (the worker's seed)
    from tests.lora.lora_moe_worker import fixed_value

    moved = [
        n
        for n in _expert_names(ref)
        if not torch.allclose(ref["adapters"][n], fixed_value(n, ref["adapters"][n].shape))
    ]
    assert len(moved) == len(_expert_names(ref))


def test_grouped_gemm_experts_refused_in_one_line():
    """GroupedMLP / TEGroupedMLP hold every expert in one stacked weight: no linear per expert to adapt."""
    from types import SimpleNamespace

    from megatron.core.transformer import TransformerConfig

    from mcore_rl.config.checks import ConfigError
    from mcore_rl.config.model import LoraConfig
    from mcore_rl.policy.lora import attach_adapters

    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=8,
                            moe_ffn_hidden_size=32, moe_grouped_gemm=True, add_bias_linear=False)  # fmt: skip
    gpt = SimpleNamespace(config=cfg)  # the refusal reads the config before touching any module
    with pytest.raises(
        ConfigError, match=r"^model.lora.target_modules: linear_fc1,linear_fc2 on grouped-GEMM "
    ):
        attach_adapters(gpt, LoraConfig(rank=4))
