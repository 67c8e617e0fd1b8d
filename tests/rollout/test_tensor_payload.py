"""Colocated tensor sync: one /update_weights_from_tensor payload per engine TP rank, each ONE flat bucket
(SGLang 0.5.23's load_format=flattened_bucket) copied onto that rank's own device. On CPU the payloads decode
in-process; the CUDA check (decode in a second process, as the SGLang server does with the IPC handles) needs a
GPU and is skipped without one."""

from __future__ import annotations

import base64
import pickle
import subprocess
import sys

import pytest
import torch

from mcore_rl.rollout.server.weight_update import flat_views
from mcore_rl.rollout.sglang.api import SGLANG_FIELDS
from mcore_rl.rollout.sglang.launcher import LauncherConfig, ServerLauncher
from mcore_rl.rollout.sglang.weight_transfer import ipc_payload, rank_devices, tensor_payload
from mcore_rl.rollout.weight_sync import flat_bucket
from tests.rollout.sglang_payloads import serialize_per_rank, tensor_update_payload

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


def test_flat_bucket_payload_per_tp_rank_on_cpu():
    named = bucket()
    payloads, copies = ipc_payload(named, rank_devices(3))
    assert len(payloads) == 3 and len(copies) == 1  # one flat copy per distinct device, shared by its ranks
    body = tensor_payload(payloads, 4, flush_cache=True)
    assert set(body) <= SGLANG_FIELDS["/update_weights_from_tensor"] and body["load_format"] == "flattened_bucket"
    for p in payloads:
        got = pickle.loads(base64.b64decode(p))
        flat, meta = got["flattened_tensor"], got["metadata"]
        assert flat.dtype == torch.uint8 and flat.dim() == 1 and flat.numel() == 16 * 8 * 4 + 4 * 8 * 2
        assert [(m.start_idx, m.end_idx, m.numel) for m in meta] == [(0, 512, 512), (512, 576, 64)]
        assert [m.dtype for m in meta] == [torch.float32, torch.bfloat16]
        for (n, a), (m, b) in zip(flat_views(flat, meta), named):  # the server's reader
            assert n == m and a.dtype == b.dtype and torch.equal(a, b)


def test_flat_groups_never_misalign_and_respect_the_size():
    named = [("a", torch.ones(3, dtype=torch.bfloat16)), ("b", torch.ones(4)), ("c", torch.ones(4)),
             ("d", torch.ones(100))]  # fmt: skip
    groups = [[n for n, _ in g] for g in flat_bucket.flat_groups(named, bucket_bytes=40)]
    # "b" (fp32) would start at byte 6: a new bucket; "d" (400 B) is larger than a bucket: its own
    assert groups == [["a"], ["b", "c"], ["d"]]
    with pytest.raises(ValueError, match="unaligned tensor b at byte 6"):
        flat_bucket.metadata([("a", (3,), torch.bfloat16), ("b", (4,), torch.float32)])


def test_each_server_reads_from_its_own_gpus(monkeypatch):
    """launcher.gpu_ids gives server k GPUs [k*tp, (k+1)*tp): its payloads must be made there (CUDA query
    patched: the device choice is what is checked)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert rank_devices(2, [4, 5, 6, 7], server=1) == [torch.device("cuda", 6), torch.device("cuda", 7)]
    assert rank_devices(2, None, server=1) == [torch.device("cuda", 0), torch.device("cuda", 1)]


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
from mcore_rl.rollout.server.weight_update import flat_views
patch_torch_reductions()
for line in sys.stdin.read().split():
    got = ForkingPickler.loads(base64.b64decode(line))
    named = flat_views(got["flattened_tensor"], got["metadata"])
    print(" ".join(f"{n}:{t.device}:{float(t.float().sum()):.6f}" for n, t in named))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (IPC handles)")
def test_cuda_payload_per_rank_decodes_in_another_process():
    named = bucket()
    tp = max(2, torch.cuda.device_count())
    payloads, copies = ipc_payload(named, rank_devices(tp))
    assert sorted(str(t.device) for t in copies) == sorted({str(d) for d in rank_devices(tp)})
    out = subprocess.run([sys.executable, "-c", DECODE], input="\n".join(payloads), capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    want = " ".join(f"{n}:{{}}:{float(t.float().sum()):.6f}" for n, t in named)
    for line, dev in zip(out.stdout.split("\n"), rank_devices(tp)):
        assert line == want.format(*[dev] * len(named)), (line, dev)
