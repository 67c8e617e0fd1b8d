"""LoRA through the trainer CLI: adapters-only checkpoints naming the base, KL against the adapters-off
reference, SIGKILL + resume reproducing the uninterrupted run's losses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.conftest import REPO, run_train_batch
from tests.e2e.test_train_tiny import FAST, _env, records, run, train_cmd

pytestmark = pytest.mark.e2e
LORA = [
    "model.lora.rank=4",
    "model.lora.alpha=16",
    "model.lora.dropout=0.0",
    "model.lora.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]",
]
COMMON = [
    *LORA,
    "trainer.steps=4",
    "trainer.save_every=2",
    "algorithm.updates_per_rollout=1",
    "eval.every=0",
    "algorithm.entropy_coef=0.01",
    "algorithm.kl_coef=0.05",
    "optim.lr=1e-2",
]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> tuple:
    """One uninterrupted LoRA run (4 updates, checkpoints at 2 and 4): (run dir, records by step)."""
    ref_dir = tmp_path_factory.mktemp("lora_cli") / "ref"
    proc = run(train_cmd(*COMMON, f"run.dir={ref_dir}"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return ref_dir, {r["step"]: r for r in records(ref_dir)}


def test_lora_checkpoint_holds_adapters_only_and_exports_agree(lora_run, tmp_path):
    ref_dir, ref = lora_run
    ckpt = ref_dir / "checkpoints" / "step_000004"
    meta = json.loads((ckpt / "complete.json").read_text())
    assert len(meta["lora_base"]["base_sha256"]) == 64
    shard_bytes = sum(p.stat().st_size for p in ckpt.rglob("*.distcp"))
    # model=tiny (hidden 64, ffn 128, 2 layers, kv 32): r * (in + out) summed over qkv, proj, fc1, fc2
    adapters = 2 * 4 * ((64 + 128) + (64 + 64) + (64 + 256) + (128 + 64))
    assert 3 * adapters * 4 <= shard_bytes < 8 * adapters * 4  # weights + Adam's two moments (fp32): no base
    assert ref[2]["kl_loss"] > 0  # the reference (adapters off) differs from the trained policy
    _peft_export_equals_merged_export(ref_dir, tmp_path)


# slow (~30 s, two more trainer runs): the SIGKILL + resume path is the full-weight one of tests/e2e/test_train_tiny.py,
# and adapters + optimizer state reloading exactly (the next step bitwise) is tests/lora/test_lora_moe.py's
@pytest.mark.slow
def test_lora_resume_after_sigkill_matches_uninterrupted(lora_run, tmp_path):
    _, ref = lora_run
    kill_dir = tmp_path / "killed"
    p = subprocess.Popen(
        train_cmd(*COMMON, f"run.dir={kill_dir}"),
        env=_env(),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    latest = kill_dir / "checkpoints" / "latest"
    deadline = time.time() + 240
    while time.time() < deadline and not latest.is_file() and p.poll() is None:
        time.sleep(0.2)
    assert latest.is_file(), "no checkpoint appeared"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL
    proc = run(train_cmd(*COMMON, f"run.dir={kill_dir}"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed = {r["step"]: r for r in records(kill_dir)}  # the resumed run's records come last
    for step in (3, 4):
        assert abs(resumed[step]["loss"] - ref[step]["loss"]) <= 1e-6, (step, resumed[step], ref[step])
    assert ref[3]["loss"] != ref[4]["loss"]


def _peft_export_equals_merged_export(run_dir, tmp_path) -> None:
    """run.dir/lora -> PEFT on the base == run.dir/hf (the merged weights the trainer streamed)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mcore_rl.convert.cli import main
    from mcore_rl.policy.lora_state import read_adapter_folder

    assert (
        main(["--quiet", "lora-to-peft", "--adapters", str(run_dir / "lora"), "--out", str(tmp_path / "p")])
        == 0
    )
    base = read_adapter_folder(run_dir / "lora")[2]["base_model"]
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval()
        before = plain(tokens).logits
        peft_logits = PeftModel.from_pretrained(plain, tmp_path / "p").eval()(tokens).logits
        merged = (
            AutoModelForCausalLM.from_pretrained(run_dir / "hf", torch_dtype=torch.float32)
            .eval()(tokens)
            .logits
        )
    assert (merged - before).abs().max().item() > 1e-4  # training moved the adapters
    assert (peft_logits - merged).abs().max().item() < 1e-4


REFUSED = {
    "q_proj": ["model.lora.rank=4", "model.lora.target_modules=[q_proj]"],
}


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict:
    """The refused LoRA settings through the CLI's main() in one interpreter (tests/train_batch.py)."""
    root = tmp_path_factory.mktemp("lora_refused")
    runs = [[*FAST, *overrides, f"run.dir={root / name}"] for name, overrides in REFUSED.items()]
    return dict(zip(REFUSED, run_train_batch(runs, root)))


def test_bad_lora_settings_one_clear_line(refused):
    proc = refused["q_proj"]
    assert proc.returncode == 2
    assert "model.lora.target_modules='q_proj'" in proc.stderr and "Traceback" not in proc.stderr


def _torchrun_two_steps(run_dir, *overrides: str) -> list[dict]:
    """Two LoRA updates through `torchrun -m mcore_rl.train` on 2 ranks; the engine sampled step 2 after a merged
    sync, so its log-probs equal the policy's."""
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "mcore_rl.train", *overrides, "model.lora.rank=4", "trainer.steps=2", "algorithm.kl_coef=0.01",
           "algorithm.entropy_coef=0.01", "optim.lr=1e-2", f"run.dir={run_dir}"]  # fmt: skip
    proc = run(cmd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = records(run_dir)
    assert [r["step"] for r in recs] == [1, 2]
    assert all(r["grad_norm"] > 1e-6 for r in recs)
    assert recs[1]["train_rollout_logprob_abs_diff"] < 1e-5
    return recs


@pytest.mark.multiproc  # ~35 s: one torchrun launch of the trainer
def test_lora_tp2_sequence_parallel_trains_through_the_cli(tmp_path):
    recs = _torchrun_two_steps(tmp_path, *FAST, "parallel.tp=2", "parallel.sequence_parallel=true")
    assert recs[1]["kl_loss"] > 0  # the adapters moved away from the base (the adapters-off reference)


@pytest.mark.multiproc
@pytest.mark.slow  # ~30 s, the EP=2 parity of tests/lora/test_lora_moe.py covers the same code
def test_lora_moe_experts_ep2_trains_through_the_cli(tmp_path):
    from tests.e2e.test_train_moe import FAST as MOE

    _torchrun_two_steps(tmp_path, *MOE, "parallel=ep2",
                        "model.lora.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]")  # fmt: skip
    from mcore_rl.policy.lora_state import read_adapter_folder

    adapters = read_adapter_folder(tmp_path / "lora")[
        0
    ]  # every expert's adapters, gathered from both EP ranks
    assert sum(".experts.local_experts." in n for n in adapters) == 2 * 8 * 2 * 2
