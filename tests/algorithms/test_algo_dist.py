"""Two gloo ranks (each with half of the prompt groups) give the single-process gradient, loss and P3O ESS."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mcore_rl.algorithms import compute_ess, make_dist_reducer
from tests.algorithms.algo_testlib import build, make_rollout, run_step

pytestmark = [pytest.mark.algorithms, pytest.mark.multiproc]

CASES: dict[str, tuple[str, dict, int]] = {   # key: (algorithm, overrides, micro-batches per rank)
    "grpo": ("grpo", {}, 2),
    "grpo_token": ("grpo", {"loss_agg_mode": "token-mean"}, 3),
    "grpo_prompt": ("grpo", {"loss_agg_mode": "prompt-mean"}, 2),
    "grpo_drnorm": ("grpo", {"loss_agg_mode": "seq-mean-token-sum-norm", "max_response_len": 16}, 2),
    "dapo": ("dapo", {"max_response_len": 16, "overlong_buffer_len": 6}, 2),
    "dr_grpo": ("dr_grpo", {}, 2),
    "mu_grpo": ("mu_grpo", {}, 2),
    "mu_grpo_seq_prompt": ("mu_grpo", {"nav_scope": "seq", "loss_agg_mode": "prompt-mean"}, 3),
    "p3o_micro": ("p3o", {}, 1),
    "p3o_batch": ("p3o", {"ess_scope": "batch"}, 2),
    "ppo_ewma": ("ppo_ewma", {"ti_level": "token", "ti_low": 0.8, "ti_high": 1.25}, 2),
    "cispo": ("cispo", {}, 2),
    "scalerl": ("scalerl", {}, 2),
    "scalerl_rewards_std": ("scalerl", {"batch_std_source": "rewards"}, 2),
}
GROUP_SIZE = 4


def run_case(key: str, ro, reduce=None):
    name, kw, splits = CASES[key]
    alg = build(name, **kw)
    kwargs = {} if reduce is None else {"reduce": reduce}
    if kw.get("ess_scope") == "batch":
        alg.set_batch_ess(compute_ess(ro.logp, ro.rollout_logp, ro.mask, **kwargs))
    return run_step(alg, ro, splits if reduce is not None else 1, **kwargs)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ro = make_rollout(seed=21)
        n = ro.mask.shape[0]
        half = (n // GROUP_SIZE // world) * GROUP_SIZE          # whole groups per rank
        local = ro.rows(slice(0, half) if rank == 0 else slice(half, n))
        reduce = make_dist_reducer()
        out = {}
        for key in CASES:
            res = run_case(key, local, reduce)
            out[key] = {"grad": res.grad_logp, "loss": res.loss, "ess": res.metrics[0].get("ess_factor"),
                        "step": res.step_metrics}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("algo_dist")
    mp.spawn(_worker, args=(2, _free_port(), str(out_dir)), nprocs=2, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("key", list(CASES))
def test_two_gloo_ranks_match_one_process(key, two_ranks):
    ref = run_case(key, make_rollout(seed=21))
    grad = torch.cat([two_ranks[0][key]["grad"], two_ranks[1][key]["grad"]])
    assert ref.grad_logp.abs().max() > 0
    assert float((grad - ref.grad_logp).abs().max()) < 1e-6
    assert two_ranks[0][key]["loss"] + two_ranks[1][key]["loss"] == pytest.approx(ref.loss, abs=1e-6)
    for r in range(2):
        assert two_ranks[r][key]["step"] == pytest.approx(ref.step_metrics, abs=1e-9)
    if key.startswith("p3o"):
        ess = ref.metrics[0]["ess_factor"]
        assert 0.05 < ess < 0.999
        assert two_ranks[0][key]["ess"] == pytest.approx(ess, rel=1e-12)
        assert two_ranks[1][key]["ess"] == pytest.approx(ess, rel=1e-12)
