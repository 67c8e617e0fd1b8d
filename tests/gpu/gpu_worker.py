"""Subprocess body for tests/gpu (process-global CUDA/NCCL state stays out of the pytest process).

  python gpu_worker.py collectives            NCCL world of 1: stop flag, PP/DP broadcasts, DP sums
  python gpu_worker.py parity MODEL_DIR        bf16 vs fp32 log-probs from the same weights + one bf16 train step
Prints one JSON line with the measured numbers.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from tests.train_step import train_step


def collectives() -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mcore_rl.distributed import (
        all_ranks_any,
        broadcast_floats,
        collective_device,
        cpu_group,
        init_distributed,
    )
    from mcore_rl.trainer.setup import StopFlag
    from mcore_rl.trainer.update import _broadcast_from_last_stage, dp_reducer

    layout = init_distributed(1, 1)
    flag = StopFlag()
    out = {"backend": dist.get_backend(), "device": str(collective_device()), "layout_device": str(layout.device),
           "cpu_group_backend": dist.get_backend(cpu_group()) if cpu_group() is not None else None,
           "stop_false": flag.agreed()}
    flag.requested = True
    out["stop_true"] = flag.agreed()
    out["any"] = all_ranks_any(True)
    pp = ps.get_pipeline_model_parallel_group()
    out["pp_broadcast"] = broadcast_floats([1.5, -2.0], src=0, group=pp)
    out["last_stage_broadcast"] = _broadcast_from_last_stage([0.25])
    dp_sum = dp_reducer()(torch.tensor([3.0, 4.0]))  # a CPU tensor through an NCCL group
    out["dp_sum"], out["dp_sum_device"] = dp_sum.tolist(), str(dp_sum.device)
    return out


def parity(model_dir: str) -> dict:
    from mcore_rl.config.optim import OptimSettings
    from mcore_rl.distributed import init_distributed
    from mcore_rl.models.spec import BuildConfig
    from mcore_rl.policy.policy import Policy, PolicyConfig
    from mcore_rl.policy.step import PolicyBatch

    init_distributed(1, 1)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 500, (4, 48), generator=g)  # tiny vocab: 512
    batch = PolicyBatch(tokens, torch.ones(4, 48))
    logp = {}
    pols = {}
    for dtype in ("fp32", "bf16"):
        build = BuildConfig(dtype=dtype, transformer_impl="local")
        pol = Policy(model_dir, PolicyConfig(build=build, optim=OptimSettings(lr=1e-3, weight_decay=0.01, adam_beta2=0.999), token_budget=256))
        pol.load_hf(model_dir)
        logp[dtype] = pol.logprobs(batch, temperature=1.0)[:, 1:].float().cpu()
        pols[dtype] = pol
    diff = (logp["bf16"] - logp["fp32"]).abs()
    pol = pols["bf16"]
    _, step = train_step(pol, batch, lambda mb, lp, ent: (-(lp * mb.loss_mask).sum() / mb.loss_mask.sum(), {}))
    after = pol.logprobs(batch, temperature=1.0)[:, 1:].float().cpu()
    return {"max_diff": diff.max().item(), "mean_diff": diff.mean().item(), "logp_mean": logp["fp32"].mean().item(),
            "train": {k: float(v) for k, v in step.items() if isinstance(v, (int, float))},
            "logp_change": (after - logp["bf16"]).mean().item()}


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    mode = sys.argv[1]
    result = collectives() if mode == "collectives" else parity(sys.argv[2])
    print("RESULT " + json.dumps(result), flush=True)
