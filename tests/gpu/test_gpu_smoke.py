"""GPU smoke suite (marker `gpu`): what only CUDA can show. Skipped on machines without CUDA.

Run on a GPU machine:  python -m pytest -q -m gpu tests/gpu
Covers: bf16 policy log-prob parity vs fp32 and a bf16 train step; an NCCL world of 1 for the stop flag and
the PP/DP broadcasts (distributed.py puts each tensor where the backend needs it); the embedded engine on
cuda; the TE layer spec with FP8 (delayed, tensorwise) when transformer_engine imports; a 2-update
`mcore-rl-train` on cuda with checkpoint + resume.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (GPU smoke suite)")]

WORKER = Path(__file__).with_name("gpu_worker.py")
HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
FAST = ["model=tiny", "trainer.prompts_per_update=4", "trainer.samples_per_prompt=4", "trainer.max_new_tokens=16",
        "eval.num_prompts=4", "eval.samples_per_prompt=2", "eval.max_new_tokens=16", "logging.progress=false",
        "logging.plot=false", "rollout.device=cuda"]


def _env() -> dict[str, str]:
    # the repo first, then whatever the caller's PYTHONPATH holds (a GPU image's extra site folder)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"}


def worker(*args: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(WORKER), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def train(*overrides: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "mcore_rl.train", *FAST, *overrides], capture_output=True, text=True,
                          timeout=900, env=_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_nccl_world_of_one_stop_flag_and_broadcasts():
    r = worker("collectives")
    assert r["backend"] == "nccl" and r["device"].startswith("cuda") and r["layout_device"] == r["device"]
    assert r["cpu_group_backend"] == "gloo"  # host-side flags never go through NCCL
    assert (r["stop_false"], r["stop_true"], r["any"]) == (False, True, True)
    assert r["pp_broadcast"] == [1.5, -2.0] and r["last_stage_broadcast"] == [0.25]
    assert r["dp_sum"] == [3.0, 4.0] and r["dp_sum_device"] == "cpu"  # back on the caller's device


def test_bf16_logprobs_match_fp32_and_train_step(tiny_llama_dir):
    """Tolerance: bf16 keeps 8 significand bits (relative rounding 2^-9 ~ 2e-3 per op). Through a 2-layer
    model and a log-softmax over the vocabulary (log-probs ~ -log V ~ -6..-11) the errors add up to a few
    1e-2 absolute at worst; 0.15 max / 0.03 mean is loose enough for that and still catches a wrong cast,
    a missing scale or a layout bug (those give O(1) differences)."""
    r = worker("parity", str(tiny_llama_dir))
    assert r["logp_mean"] < -1.0  # a real distribution, not all-zero log-probs
    assert r["max_diff"] < 0.15 and r["mean_diff"] < 0.03, r
    assert math.isfinite(r["train"].get("grad_norm", float("nan"))) and r["train"]["grad_norm"] > 0
    assert r["logp_change"] > 0  # the step raised the log-probs it was trained to raise


def test_packed_rows_through_flash_varlen_match_padded(tiny_llama_dir):
    """bf16 on CUDA: ragged rows packed run one flash varlen call per layer (models/varlen.py) and give the padded
    rows' log-probs within bf16's tolerance (as the parity test above) and the same gradient direction."""
    from mcore_rl.models import varlen

    if varlen.api() is None:
        pytest.skip("this PyTorch has no torch.nn.attention.varlen")
    r = worker("packed", str(tiny_llama_dir))
    # forward-only and train passes, every layer of every micro-batch
    assert r["varlen_calls"] == 2 * r["layers"] * r["micro_batches"], r
    assert r["logp_mean"] < -1.0 and r["max_diff"] < 0.15 and r["mean_diff"] < 0.03, r
    assert r["grad_norm"] > 0 and r["grad_cos"] > 0.99, r


def test_local_engine_generates_on_cuda(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from mcore_rl.policy.logprobs import reference_logprobs
    from mcore_rl.rollout.local.engine import LocalEngine
    from mcore_rl.rollout.protocol import GenerationRequest, SamplingParams

    engine = LocalEngine(str(tiny_llama_dir), device="cuda", dtype="float32", seed=0)
    try:
        req = GenerationRequest(prompt_ids=[1, 5, 9, 14], rid="a",
                                sampling=SamplingParams(max_new_tokens=12, temperature=1.0, n=2, seed=3,
                                                        ignore_eos=True))  # random weights: EOS may come first
        samples = engine.generate([req])
    finally:
        engine.close()
    assert [len(s.output_ids) for s in samples] == [12, 12]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).cuda().eval()
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.output_ids], device="cuda")
        with torch.no_grad():
            ref = reference_logprobs(hf(ids).logits[:, :-1].float(), ids[:, 1:], 1.0)[0, len(s.prompt_ids) - 1:]
        assert (ref.cpu() - torch.tensor(s.output_logprobs)).abs().max().item() < 1e-3


@pytest.mark.skipif(not HAVE_TE, reason="transformer_engine does not import")
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_te_fp8_train_step(recipe, tmp_path):
    train("model.transformer_impl=transformer_engine", "model.dtype=bf16", "model.fp8.enabled=true",
          f"model.fp8.recipe={recipe}", "trainer.steps=1", "trainer.export_hf=false", f"run.dir={tmp_path}")
    (rec,) = records(tmp_path / "metrics.jsonl")
    assert math.isfinite(rec["loss"]) and math.isfinite(rec["grad_norm"])


def test_train_two_updates_on_cuda_then_resume(tmp_path):
    train("trainer.steps=2", f"run.dir={tmp_path}")
    assert [r["step"] for r in records(tmp_path / "metrics.jsonl")] == [1, 2]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert (tmp_path / "hf" / "config.json").is_file()
    proc = train("trainer.steps=3", f"run.dir={tmp_path}")
    assert "resumed from" in proc.stderr and "at update 2" in proc.stderr
    recs = records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in recs)


def test_lora_bf16_trains_on_cuda(tmp_path):
    """LoRA on CUDA in bf16: adapters only train, the frozen base stays in bf16, the adapters-off reference runs
    on the same model, and a checkpoint holds the adapters."""
    from tests.e2e.sevens import TINY_TASK, assert_trains

    train(*TINY_TASK, "model.dtype=bf16", "model.lora.rank=8", "model.lora.alpha=16", "trainer.steps=3",
          "trainer.export_hf=false", f"run.dir={tmp_path}")
    recs = records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in recs)
    assert_trains(recs)


def test_multi_turn_tool_episodes_async_on_cuda(tmp_path):
    """env=calculator under the async schedule on CUDA: tool turns in the sandboxed pool between model turns on
    the GPU engine, masked tool tokens, real gradient steps on stale episodes."""
    from tests.trainer.test_env_cli import CALC

    plugins = "import tests.trainer.episode_plugins; from mcore_rl.train import main; main()"
    cmd = [sys.executable, "-c", plugins, *FAST, *CALC, "schedule=async", "trainer.steps=3",
           "trainer.export_hf=false", f"run.dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = records(tmp_path / "metrics.jsonl")
    assert len(recs) == 3 and max(r["env/turns"] for r in recs) > 1.0
    assert min(r["env/policy_token_frac"] for r in recs) < 1.0 and max(r["grad_norm"] for r in recs) > 0
