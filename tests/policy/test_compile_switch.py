"""`model.compile`: the typed switch between the compiled element-wise ops and eager PyTorch, through the CLI.

The trainer CLI in bf16 with model.compile=false must take the eager path everywhere (no module swapped, the
process-wide switch off for RoPE and the log-softmax) and still train; the default (auto: compiled on CPU; on CUDA
the layers' ops eager and the LM head's log-prob kernels compiled) swaps every norm and MLP on a CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mcore_rl.compat import fused_ops
from tests.config.keyscan import compose
from tests.conftest import REPO

pytestmark = pytest.mark.e2e


def test_model_compile_reaches_the_build_config():
    from mcore_rl.config import load_config
    from mcore_rl.trainer.setup import build_config

    assert build_config(load_config(compose(["model=tiny"]))).compile is True  # the default (auto) on a CPU
    assert build_config(load_config(compose(["model=tiny", "model.compile=false"]))).compile is False
    assert build_config(load_config(compose(["model=tiny", "model.compile=true"]))).compile is True


def test_auto_compiles_on_cpu_and_runs_eager_on_cuda(monkeypatch):
    """auto: compiled on CPU, eager on CUDA (an H100 ran the bf16 step faster eager); true/false win anywhere."""
    import torch

    from mcore_rl.config import load_config
    from mcore_rl.trainer.setup import build_config, resolve_compile

    assert (resolve_compile("auto", cuda=False), resolve_compile("auto", cuda=True)) == (True, False)
    assert (resolve_compile("true", cuda=True), resolve_compile("false", cuda=False)) == (True, False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    auto = build_config(load_config(compose(["model=tiny"])))
    assert (auto.compile, auto.compile_head) == (False, True)  # eager layers, compiled LM head on CUDA
    forced = build_config(load_config(compose(["model=tiny", "model.compile=true"])))
    assert (forced.compile, forced.compile_head) == (True, True)
    off = build_config(load_config(compose(["model=tiny", "model.compile=false"])))
    assert (off.compile, off.compile_head) == (False, False)


def test_the_lm_head_kernels_follow_their_own_switch(monkeypatch):
    """On CUDA `auto` runs the layers' ops eager but the LM head's per-chunk log-prob kernels compiled (a few calls
    per step over GiB chunks: an H200 spent ~40% of a 0.5B bf16 step's GPU time in their eager passes)."""
    import torch

    from mcore_rl.policy import chunked_head
    from mcore_rl.policy.chunked_head import _chunk_grad, _chunk_stats, _kernels

    monkeypatch.setattr(chunked_head, "_COMPILED", {})
    monkeypatch.setattr(fused_ops, "_ENABLED", True)
    monkeypatch.setattr(fused_ops, "_HEAD_ENABLED", True)
    try:
        fused_ops.set_compile(False, head=True)  # auto on CUDA
        assert not fused_ops.compile_enabled() and fused_ops.head_compile_enabled()
        stats, grad = _kernels(torch.bfloat16, 152_064, 896)
        assert (stats.__wrapped__, grad.__wrapped__) == (_chunk_stats, _chunk_grad)  # the compiled wrappers
        fused_ops.set_compile(False)  # model.compile=false: the head follows
        assert not fused_ops.head_compile_enabled()
        assert _kernels(torch.bfloat16, 152_064, 896) == (_chunk_stats, _chunk_grad)
    finally:
        fused_ops.set_compile(True)
    assert fused_ops.head_compile_enabled()


def test_a_bad_compile_value_is_one_config_error():
    from mcore_rl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"model.compile.*'maybe'.*auto"):
        load_config(compose(["model=tiny", "model.compile=maybe"]))


def test_set_compile_switches_the_compiled_functions(monkeypatch):
    """Off: the compiled wrappers call their eager function (a call the compiler never sees)."""
    seen = []
    monkeypatch.setattr(fused_ops, "_ENABLED", True)
    wrapped = fused_ops._compiled(lambda x: seen.append("eager") or x)
    fused_ops.set_compile(False)
    try:
        assert not fused_ops.compile_enabled()
        assert wrapped(3) == 3 and seen == ["eager"]
    finally:
        fused_ops.set_compile(True)
    assert fused_ops.compile_enabled()


def test_cli_bf16_with_compile_false_runs_eager(tmp_path):
    """Two steps of `mcore_rl.train model=tiny model.dtype=bf16 model.compile=false` (~30-60 s on 2 cores)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    run_dir = tmp_path / "eager"
    cmd = [sys.executable, "-m", "mcore_rl.train", "model=tiny", "model.dtype=bf16", "model.compile=false",
           "eval.num_prompts=0", "trainer.prompts_per_update=2", "trainer.samples_per_prompt=2",
           "trainer.max_new_tokens=8", "logging.progress=false", "trainer.export_hf=false", "logging.plot=false",
           "trainer.steps=2", f"run.dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stderr
    assert "fused_ops: eager element-wise ops (model.compile=false, or auto on CUDA; no modules swapped)" in log
    assert "fused_ops: compiled element-wise ops" not in log
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2] and all(r["update_ok"] == 1.0 for r in recs)
    assert 0 < recs[-1]["train_rollout_logprob_abs_diff"] < 0.5
    assert "compile: 'false'" in (run_dir / "config.yaml").read_text()



def test_the_cuda_default_eager_layers_and_compiled_head_trains_on_cpu(tiny_llama_dir):
    """What `auto` builds on CUDA (layers' element-wise ops eager, the LM head's kernels compiled), built and
    stepped on a CPU: no module swapped, the head's kernels ran compiled (or fell back visibly), and log-probs and
    gradients as the all-eager build's (the head computes in fp32 either way)."""
    import torch

    from mcore_rl.distributed import init_distributed
    from mcore_rl.models.spec import BuildConfig
    from mcore_rl.policy.policy import Policy, PolicyConfig
    from mcore_rl.policy.step import PolicyBatch

    init_distributed(1, 1)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 512, (4, 16), generator=g)
    mask = torch.zeros(4, 16)
    mask[:, 4:] = 1.0
    adv = torch.randn(4, 1, generator=g).expand(4, 16).contiguous()

    def loss_fn(mb, logp, ent):
        return -(mb.extras["adv"] * logp * mb.loss_mask).sum(), {}

    out = []
    try:
        for head in (True, False):
            pol = Policy(tiny_llama_dir, PolicyConfig(build=BuildConfig(dtype="bf16", compile=False, compile_head=head),
                                                      token_budget=128))
            pol.load_hf(tiny_llama_dir)
            assert not any(pol.gpt.fused_ops.values())  # no norm or MLP swapped: Megatron's eager modules
            assert (fused_ops.compile_enabled(), fused_ops.head_compile_enabled()) == (False, head)
            before = dict(fused_ops.compiled_calls())
            pol.zero_grad()
            pol.forward_backward(PolicyBatch(tokens, mask, {"adv": adv}), loss_fn)
            ran = fused_ops.compiled_calls().get("_chunk_grad", 0) - before.get("_chunk_grad", 0)
            grads = torch.cat([p.main_grad.flatten().float() for p in pol.model.parameters()])
            with torch.no_grad():
                logp = pol.logprobs(PolicyBatch(tokens, mask))
            out.append((logp, grads, ran))
    finally:
        fused_ops.set_compile(True)
    (lp1, g1, ran1), (lp0, g0, ran0) = out
    assert (ran1 > 0 or "_chunk_grad" in fused_ops.fallbacks()) and ran0 == 0
    assert lp0.min().item() < -3.0 and (lp0 - lp1).abs().max().item() < 1e-3
    assert g0.abs().max().item() > 1e-3 and ((g0 - g1).abs().max() / g0.abs().max()).item() < 2e-2
