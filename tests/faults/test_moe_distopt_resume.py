"""MoE (tiny Qwen3-MoE, EP=2 over 2 ranks) with Megatron's distributed optimizer through the real CLI: the trainer is
SIGKILLed right after the step-2 checkpoint is published, resumes from it, and steps 3-4 reproduce the
uninterrupted run's losses within 1e-6 (fp32), full-weight and with LoRA on attention and every expert; a dense model
at DP=2 likewise. Megatron-Core
0.16.1's default distributed-optimizer format could not be saved at all ("ShardedTensor.flattened_range is not
supported"), and its torch-Adam resume shared one `step` tensor between parameters (compat/distopt.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.faultlib import records, train

pytestmark = [pytest.mark.faults, pytest.mark.multiproc]

RUN = ["optim.use_distributed_optimizer=true", "trainer.steps=4", "trainer.save_every=2", "trainer.keep_checkpoints=2",
       "trainer.export_hf=false"]  # fmt: skip
MOE = ["model=tiny_moe", "parallel=ep2"]
LORA = ["model.lora.rank=4", "model.lora.alpha=16", "model.lora.dropout=0.0",
        "model.lora.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]"]  # fmt: skip
VARIANTS = {"moe_full": MOE, "moe_lora": [*MOE, *LORA], "dense_dp2": []}  # dense: tiny Llama, DP=2
TOL = 1e-6


def _run(run_dir: Path, extra: list[str], **env: str):
    return train(*RUN, *extra, f"run.dir={run_dir}", nproc=2, timeout=600, **env)


@pytest.mark.slow  # two 2-rank runs of 4 updates (+ a 2-update one) with checkpoints: ~2 min on 2 cores
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_distributed_optimizer_resumes_exactly(variant, tmp_path):
    extra = VARIANTS[variant]
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    proc = _run(ref_dir, extra)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ref = records(ref_dir)
    assert sorted(ref) == [1, 2, 3, 4]
    assert len({ref[s]["loss"] for s in ref}) == 4  # the losses move: the comparison can fail

    proc = _run(run_dir, extra, MCORE_RL_CRASH_AT="after_latest:2")  # killed once step_2 is published
    assert proc.returncode != 0
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step_000002"
    assert sorted(records(run_dir)) == [1, 2]

    proc = _run(run_dir, extra)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"resumed from {ckpt / 'step_000002'}" in proc.stderr, proc.stderr[-3000:]
    got = records(run_dir)
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):
        assert abs(got[step]["loss"] - ref[step]["loss"]) <= TOL, (step, got[step]["loss"], ref[step]["loss"])
        assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-5)
        assert got[step]["reward_mean"] == ref[step]["reward_mean"]
