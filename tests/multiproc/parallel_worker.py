"""torchrun worker: load one torch_dist checkpoint at some TP/PP/DP, report log-probs, one Adam step, grad norm.

Usage: parallel_worker.py --hf DIR --ckpt DIR --tp N --pp M --out FILE [--save-init]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mcore_rl.checkpoint_io import load_dist_checkpoint, save_dist_checkpoint
from mcore_rl.config.optim import OptimSettings
from mcore_rl.distributed import init_distributed
from mcore_rl.models.spec import BuildConfig
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


@dataclass
class StepResult:
    batch: PolicyBatch
    mask: torch.Tensor
    before: torch.Tensor  # log-probs of the fixed batch before the step
    after: torch.Tensor  # ... and after one optimizer step
    stats: dict
    is_reporter: bool  # last PP stage, TP rank 0, DP rank 0: the rank that holds the full log-probs


def step_from_shared_checkpoint(policy: Policy, hf: str, ckpt: str, save_init: bool) -> StepResult:
    """Every layout starts from ONE torch_dist checkpoint (init is not PP-invariant), then takes one step.

    `save_init` (a single-rank run) writes that checkpoint from the HF weights instead of loading it."""
    if save_init:
        policy.load_hf(hf)
        save_dist_checkpoint(ckpt, policy.model, overwrite=True)
    else:
        load_dist_checkpoint(ckpt, policy.model)
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
    return StepResult(batch, mask, before, after, stats, is_reporter)


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
                       optim=OptimSettings(lr=1e-3, weight_decay=0.0, adam_beta2=0.999, clip_grad=0.0,
                                           use_distributed_optimizer=a.distributed_optimizer),
                       token_budget=48)
    policy = Policy(a.hf, cfg)
    res = step_from_shared_checkpoint(policy, a.hf, a.ckpt, a.save_init)
    if res.is_reporter:
        torch.save({"before": res.before * res.mask, "after": res.after * res.mask,
                    "grad_norm": res.stats["grad_norm"], "world": layout.world_size}, a.out)
        print(json.dumps({"grad_norm": res.stats["grad_norm"]}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
