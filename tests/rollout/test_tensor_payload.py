"""Colocated tensor sync: one /update_weights_from_tensor payload per engine TP rank, each made from a copy on
that rank's own device. On CPU the payloads decode in-process; the CUDA check (decode in a second process, as
the SGLang server does with the IPC handles) needs a GPU and is skipped without one."""

from __future__ import annotations

import base64
import pickle
import subprocess
import sys

import pytest
import torch

from mcore_rl.rollout.sglang.api import SGLANG_FIELDS, serialize_per_rank, tensor_update_payload
from mcore_rl.rollout.sglang.launcher import LauncherConfig, ServerLauncher
from mcore_rl.rollout.sglang.weight_transfer import rank_devices

pytestmark = pytest.mark.rollout


def bucket():
    torch.manual_seed(0)
    return [("model.layers.0.mlp.up_proj.weight", torch.randn(16, 8)), ("lm_head.weight", torch.randn(4, 8).bfloat16())]


def test_one_payload_per_tp_rank_on_cpu():
    named = bucket()
    payloads, alive = serialize_per_rank(named, rank_devices(3))
    assert len(payloads) == 3 and len(alive) == 3
    body = tensor_update_payload(payloads, 4)
    assert set(body) <= SGLANG_FIELDS["/update_weights_from_tensor"] and body["weight_version"] == "4"
    for p in payloads:
        got = pickle.loads(base64.b64decode(p))
        assert [n for n, _ in got] == [n for n, _ in named]
        assert all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(got, named))


def test_launcher_flags_for_sglang_and_mcore_rl_serve():
    cfg = LauncherConfig(model_path="/m", tp_size=2, memory_saver=True, deterministic=True, api_key="k3y")
    launcher = ServerLauncher(cfg)
    cmd = launcher._fmt(cfg.command, model_path="/m", tp_size=2, port=1, host="h")
    assert cmd[cmd.index("--tp-size") + 1] == "2" and cmd[-1] == "--api-key=k3y"  # SGLang has no env var
    serve = ServerLauncher(LauncherConfig(model_path="/m", server="mcore-rl-serve", api_key="k3y"))
    assert "k3y" not in serve._fmt(serve.cfg.command, model_path="/m", tp_size=1, port=1, host="h")  # env only
    with pytest.raises(ValueError, match="launcher.server='vllm'"):
        LauncherConfig(model_path="/m", server="vllm")


DECODE = r"""
import base64, sys, torch
from multiprocessing.reduction import ForkingPickler
from mcore_rl.rollout.sglang.api import patch_torch_reductions
patch_torch_reductions()
for line in sys.stdin.read().split():
    named = ForkingPickler.loads(base64.b64decode(line))
    print(" ".join(f"{n}:{t.device}:{float(t.float().sum()):.6f}" for n, t in named))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (IPC handles)")
def test_cuda_payload_per_rank_decodes_in_another_process():
    named = bucket()
    tp = max(2, torch.cuda.device_count())
    payloads, alive = serialize_per_rank(named, rank_devices(tp))
    assert [str(t.device) for c in alive for _, t in c[:1]] == [str(d) for d in rank_devices(tp)]
    out = subprocess.run([sys.executable, "-c", DECODE], input="\n".join(payloads), capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    want = " ".join(f"{n}:{{}}:{float(t.float().sum()):.6f}" for n, t in named)
    for line, dev in zip(out.stdout.split("\n"), rank_devices(tp)):
        assert line == want.format(*[dev] * len(named)), (line, dev)
