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


def packed(model_dir: str) -> dict:
    """bf16 on CUDA: ragged rows packed (one flash varlen call per layer, models/varlen.py) against the same rows
    padded: log-probs and gradients, and how many varlen calls ran."""
    from mcore_rl.config.optim import OptimSettings
    from mcore_rl.distributed import init_distributed
    from mcore_rl.models import varlen
    from mcore_rl.models.spec import BuildConfig
    from mcore_rl.policy.policy import Policy, PolicyConfig
    from mcore_rl.policy.step import PolicyBatch, run_forward_backward

    init_distributed(1, 1)
    calls = []
    real = varlen.packed_causal
    varlen.packed_causal = lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 500, (6, 64), generator=g)  # tiny vocab: 512
    mask = torch.zeros(6, 64)
    for i, n in enumerate([64, 17, 40, 9, 55, 30]):
        mask[i, 4:n] = 1.0
    adv = torch.randn(6, 1, generator=g).expand(6, 64).contiguous()
    batch = PolicyBatch(tokens, mask, {"adv": adv})
    build = BuildConfig(dtype="bf16", transformer_impl="local")
    pol = Policy(model_dir, PolicyConfig(build=build, optim=OptimSettings(lr=1e-3), token_budget=4096))
    pol.load_hf(model_dir)
    mbs = pol.micro_batches(batch)

    def loss_fn(mb, logp, ent):
        return -(mb.extras["adv"] * logp * mb.loss_mask).sum(), {}

    res = []
    for pack in (False, True):
        pol.model.zero_grad_buffer()
        run_forward_backward(pol.model, mbs, pol.args.vocab_size, loss_fn, 1.0, packed=pack)
        grads = torch.cat([p.main_grad.flatten().float().clone() for p in pol.model.parameters()])
        with torch.no_grad():
            outs = run_forward_backward(pol.model, mbs, pol.args.vocab_size, None, 1.0, packed=pack)
        res.append((torch.cat([o["logp"].flatten() for o in outs]).float().cpu(), grads.cpu()))
    (lp0, g0), (lp1, g1) = res
    scored = lp0 != 0  # both passes score the same positions of the same micro-batches (zeros elsewhere)
    lp0, lp1 = lp0[scored], lp1[scored]
    cos = torch.nn.functional.cosine_similarity(g0, g1, dim=0).item()
    return {"varlen_calls": len(calls), "layers": pol.args.num_layers, "micro_batches": len(mbs),
            "max_diff": (lp0 - lp1).abs().max().item(), "mean_diff": (lp0 - lp1).abs().mean().item(),
            "logp_mean": lp0.mean().item(), "grad_cos": cos, "grad_norm": g0.norm().item()}


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    mode = sys.argv[1]
    result = {"collectives": lambda: collectives(), "parity": lambda: parity(sys.argv[2]),
              "packed": lambda: packed(sys.argv[2])}[mode]()
    print("RESULT " + json.dumps(result), flush=True)
