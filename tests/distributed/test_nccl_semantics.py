"""The collective layer under NCCL semantics, in one CPU process: every helper and every migrated call site hands
NCCL groups only tensors on the (stand-in) CUDA device, pickles and host flags only to the gloo host group, and
returns results on the caller's device. Under gloo, everything travels on the CPU.

The strict recorders (tests/distributed/nccl_standin.py) raise NCCL's own error for a CPU tensor, so a call site
that bypasses the layer fails here as it would on a GPU cluster.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import mcore_rl.distributed as D

pytestmark = pytest.mark.multiproc  # real Megatron groups (one gloo rank)


# ---- the strict recorder itself --------------------------------------------------------------------------------
def test_a_cpu_tensor_on_an_nccl_group_fails_like_nccl(nccl):
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.ones(2))  # the pre-layer call sites did exactly this
    with pytest.raises(RuntimeError, match="device type cpu"):
        dist.broadcast(torch.ones(2), src=0)
    with pytest.raises(RuntimeError, match="device type cpu"):
        dist.all_gather([torch.empty(2)], torch.ones(2))
    with pytest.raises(RuntimeError, match="device type lazy"):  # and gloo (the host group) takes no device tensor
        dist.all_reduce(torch.ones(2).to(nccl.device), group=nccl.host_group)
    with pytest.raises(RuntimeError, match="gloo host group only"):
        dist.broadcast_object_list([1], src=0)
    t = torch.tensor([3.0]).to(nccl.device)
    dist.all_reduce(t)  # a device tensor passes, and really is reduced (one rank: unchanged)
    assert t.cpu().tolist() == [3.0] and nccl.ops() == [("all_reduce", "lazy", False)]


def test_group_device_follows_the_backend(nccl):
    assert D.group_device() == nccl.device and D.group_device(nccl.host_group) == torch.device("cpu")


# ---- every helper ----------------------------------------------------------------------------------------------
def test_all_reduce_moves_to_the_group_device_and_back(nccl):
    x = torch.tensor([1.5, -2.0], dtype=torch.float64)
    for op in ("sum", "max", "min"):
        out = D.all_reduce(x, op)
        assert out.device == x.device and out.dtype == x.dtype and out.tolist() == [1.5, -2.0]
        assert out.data_ptr() != x.data_ptr()  # fresh: callers may pass views they keep using
    ints = D.all_reduce(torch.tensor([7]), "max")
    assert ints.tolist() == [7] and ints.dtype == torch.int64
    assert nccl.ops() == [("all_reduce", "lazy", False)] * 4
    with pytest.raises(ValueError, match="reduce op 'avg'"):
        D.all_reduce(x, "avg")


def test_all_gather_broadcast_and_floats(nccl):
    parts = D.all_gather(torch.arange(3.0))
    assert [p.device.type for p in parts] == ["cpu"] and parts[0].tolist() == [0.0, 1.0, 2.0]
    t = torch.tensor([4.0, 5.0])
    assert D.broadcast(t, src=0) is t and t.tolist() == [4.0, 5.0]
    view = torch.arange(6.0).reshape(2, 3)[:, 1]  # a non-contiguous CPU view: copied back into place
    assert D.broadcast(view, src=0).tolist() == [1.0, 4.0]
    assert D.broadcast_floats([0.25, 3.0], src=0) == [0.25, 3.0]
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_group()
    assert D.broadcast_from_group_rank(torch.tensor([2.0]), 0, dp).tolist() == [2.0]
    assert D.sum_reducer(dp)(torch.tensor([1.0, 2.0])).tolist() == [1.0, 2.0]
    assert [op for op, _, _ in nccl.ops()] == ["all_gather", "broadcast", "broadcast", "broadcast", "broadcast",
                                               "all_reduce"]
    assert {(dev, host) for _, dev, host in nccl.ops()} == {("lazy", False)}


def test_host_side_values_use_the_gloo_group(nccl, world, monkeypatch):
    assert D.all_ranks_any(True) is True and D.all_ranks_any(False) is False
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)  # barrier/object paths skip a 1-rank world
    D.barrier()
    assert D.broadcast_object({"a": [1, 2]}) == {"a": [1, 2]}
    assert nccl.ops() == [("all_reduce", "cpu", True), ("all_reduce", "cpu", True), ("barrier", "", True),
                          ("broadcast_object_list", "", True)]


def test_gloo_groups_get_cpu_tensors(gloo):
    assert D.group_device() == torch.device("cpu")
    D.all_reduce(torch.ones(1))
    D.all_gather(torch.ones(1))
    D.broadcast(torch.ones(1), 0)
    assert {dev for _, dev, _ in gloo.ops()} == {"cpu"} and len(gloo.ops()) == 3
    with pytest.raises(RuntimeError, match="device type lazy"):  # gloo refuses the device tensor
        dist.all_reduce(torch.ones(1).to(gloo.device))


# ---- the migrated call sites -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def policy(world, tiny_llama_dir):
    from mcore_rl.policy.policy import Policy, PolicyConfig

    pol = Policy(tiny_llama_dir, PolicyConfig(token_budget=64))
    pol.load_hf(tiny_llama_dir)
    return pol


def test_disabled_load_check_runs_no_collective(nccl, policy, tiny_llama_dir):
    from mcore_rl.convert.load_check import LoadCheckConfig, run_load_check

    nccl.forbid_all = True
    for cfg, from_hf in ((LoadCheckConfig(enabled="false"), True), (LoadCheckConfig(enabled="auto"), False)):
        res = run_load_check(policy, tiny_llama_dir, cfg, from_hf=from_hf)
        assert not res.ran and nccl.calls == []
    assert "enabled=false" in run_load_check(policy, tiny_llama_dir, LoadCheckConfig(enabled="false")).reason


def test_load_check_reductions_on_the_device(nccl, policy, tiny_llama_dir):
    from mcore_rl.convert.load_check import LoadCheckConfig, run_load_check

    res = run_load_check(policy, tiny_llama_dir, LoadCheckConfig(enabled="auto", tol=1e-4))
    assert res.ran and res.max_abs_diff < 1e-4 and res.n_tokens > 0, res
    # auto: the parameter count (device), the memory agreement (host), the max logit difference (device)
    assert nccl.ops() == [("all_reduce", "lazy", False), ("all_reduce", "cpu", True), ("all_reduce", "lazy", False)]


def test_policy_dp_padding_and_logprobs(nccl, policy, monkeypatch):
    from megatron.core import parallel_state as ps

    from mcore_rl.policy.step import PolicyBatch, split_micro_batches

    tokens = torch.randint(0, 512, (3, 20), generator=torch.Generator().manual_seed(0))
    batch = PolicyBatch(tokens, torch.ones(3, 20))
    monkeypatch.setattr(ps, "get_data_parallel_world_size", lambda *a, **k: 2)  # reach the DP>1 branch, 1 rank
    mbs = policy.micro_batches(batch)
    assert len(mbs) == len(split_micro_batches(batch, 64)) and nccl.ops() == [("all_reduce", "lazy", False)]


def test_audit_moe_metrics_reducer_and_precision(nccl, policy, monkeypatch):
    from mcore_rl.algorithms.reduce import make_dist_reducer
    from mcore_rl.batch import RolloutBatch
    from mcore_rl.oldlogp.audit import Auditor
    from mcore_rl.policy import precision
    from mcore_rl.policy.moe_metrics import RouterLoad

    n, L = 4, 12
    tokens = torch.randint(0, 512, (n, L), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(n, L)
    mask[:, 6:] = 1
    rb = RolloutBatch(tokens, mask, torch.zeros(n, L), torch.where(mask > 0, 0, -1), torch.arange(n),
                      torch.zeros(n), torch.zeros(n), torch.full((n,), 6), torch.zeros(n))
    exact = policy.logprobs(rb.policy_batch())
    old = exact + 0.25 * mask  # every response token off by 0.25
    stats = Auditor(1.0, seed=0).measure(policy, None, rb, old, version=0, temperature=1.0)
    assert stats["old_logp_error"] == pytest.approx(0.25, abs=1e-6)
    assert stats["old_logp_error_max"] == pytest.approx(0.25, abs=1e-6) and stats["old_logp_stale_token_frac"] == 0
    assert nccl.ops() == [("all_reduce", "lazy", False)]

    load = RouterLoad(torch.nn.Linear(2, 2), num_experts=4)  # no routers: counts are filled by hand
    load.counts += torch.tensor([1.0, 1.0, 2.0, 4.0], dtype=torch.float64)
    out = load.read()
    assert out["moe_load_e3"] == 0.5 and out["moe_load_max_over_mean"] == 2.0 and load.counts.sum() == 0
    assert len(nccl.calls) == 2

    x = torch.tensor([2.0, 3.0])
    assert make_dist_reducer()(x).tolist() == [2.0, 3.0] and len(nccl.calls) == 3

    monkeypatch.setattr(precision, "measure_matmul_rates", lambda: precision.MatmulRates(100.0, 10.0))
    assert precision._decide_auto() == "fp32"
    assert nccl.ops()[1:] == [("all_reduce", "lazy", False), ("all_reduce", "lazy", False),
                              ("broadcast", "lazy", False)]


def test_checkpoint_barrier_is_host_side(nccl, monkeypatch):
    from mcore_rl import checkpoint_io

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    checkpoint_io._barrier()
    assert nccl.ops() == [("barrier", "", True)]


def test_timeout_must_be_positive():
    for bad in (0, -5, True, "600"):
        with pytest.raises(ValueError, match="timeout_s=.* must be > 0"):
            D.init_distributed(timeout_s=bad)
