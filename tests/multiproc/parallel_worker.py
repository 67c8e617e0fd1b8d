"""torchrun worker: load one torch_dist checkpoint at some TP/PP/DP, report log-probs, one Adam step, grad norm.

Usage: parallel_worker.py --hf DIR --ckpt DIR --tp N --pp M --out FILE [--save-init]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from mcore_rl.checkpoint_io import load_dist_checkpoint, save_dist_checkpoint
from mcore_rl.distributed import init_distributed
from mcore_rl.models.spec import BuildConfig
from mcore_rl.policy.build import OptimConfig
from mcore_rl.policy.policy import Policy, PolicyConfig
from mcore_rl.policy.step import PolicyBatch


def fixed_batch(vocab: int) -> tuple[PolicyBatch, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    n, L = 8, 24
    tokens = torch.randint(0, vocab, (n, L), generator=g)
    lengths = torch.randint(12, L + 1, (n,), generator=g)
    mask = torch.zeros(n, L)
    for i, ln in enumerate(lengths.tolist()):
        mask[i, 6:ln] = 1.0
        tokens[i, ln:] = 0
    adv = torch.randn(n, generator=g)
    weight = mask * adv[:, None] / mask.sum()  # global token-mean with a per-sequence advantage
    return PolicyBatch(tokens, mask, {"weight": weight}), mask


def loss_fn(mb: PolicyBatch, logp: torch.Tensor, ent):
    return -(mb.extras["weight"] * logp).sum(), {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--save-init", action="store_true")
    ap.add_argument("--distributed-optimizer", action="store_true")
    a = ap.parse_args()
    layout = init_distributed(a.tp, a.pp)
    cfg = PolicyConfig(build=BuildConfig(tp=a.tp, pp=a.pp),
                       optim=OptimConfig(lr=1e-3, weight_decay=0.0, clip_grad=0.0,
                                         use_distributed_optimizer=a.distributed_optimizer),
                       token_budget=48)
    policy = Policy(a.hf, cfg)
    if a.save_init:
        policy.load_hf(a.hf)
        save_dist_checkpoint(a.ckpt, policy.model, overwrite=True)
    else:
        load_dist_checkpoint(a.ckpt, policy.model)
        policy._sync_main_params()
    batch, mask = fixed_batch(policy.args.vocab_size)
    before = policy.logprobs(batch)
    # data parallel: each DP rank trains on its own rows; weights are global, so the summed loss is the same
    from megatron.core import parallel_state as ps

    dp, dpr = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = [i for i in range(len(batch)) if i % dp == dpr]
    _, stats = policy.train_step(batch.select(rows), loss_fn)
    after = policy.logprobs(batch)
    is_reporter = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and dpr == 0
    if is_reporter:
        torch.save({"before": before * mask, "after": after * mask, "grad_norm": stats["grad_norm"],
                    "world": layout.world_size}, a.out)
        print(json.dumps({"grad_norm": stats["grad_norm"]}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
