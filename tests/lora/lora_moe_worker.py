"""torchrun worker: a LoRA policy on the tiny Qwen3-MoE with adapters on attention AND every expert's fc1/fc2, at
some expert-parallel size, from the HF base + fixed non-zero adapters (seeded by canonical name, so every layout
holds the same values). Reports log-probs, one Adam step's adapter grad norm, post-step log-probs, the gathered
adapters, the embedded engine's log-probs after a merged-weight sync, and a dist-checkpoint resume: step 2 taken
after reloading the step-1 checkpoint (adapters + optimizer) must equal step 2 taken straight on.

Usage: lora_moe_worker.py --hf DIR --ep E --ckpt DIR --out FILE [--distributed-optimizer]
"""

from __future__ import annotations

import argparse
import zlib

import torch
import torch.distributed as dist

from mcore_rl.config.model import LoraConfig
from mcore_rl.config.optim import OptimSettings
from mcore_rl.distributed import init_distributed
from mcore_rl.models.spec import BuildConfig
from mcore_rl.policy.lora_state import _local_adapters, gather_adapters, load_adapters
from mcore_rl.policy.policy import Policy, PolicyConfig
from tests.multiproc.launch import fixed_batch, loss_fn
from tests.multiproc.moe_worker import engine_logprobs
from tests.train_step import train_step

RANK, ALPHA = 4, 8.0
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def fixed_adapters(model):
    """Full canonical adapter values; shapes from this rank's tensors (TP=1: every local tensor is full)."""
    shapes = {name: tuple(p.shape) for name, _, _, p in _local_adapters(model)}

    return lambda name: fixed_value(name, shapes[name])


def fixed_value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g) * 0.3


def _step(policy, batch):
    from megatron.core import parallel_state as ps

    dp, dpr = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    _, stats = train_step(policy, batch.select([i for i in range(len(batch)) if i % dp == dpr]), loss_fn)
    return stats


def _resume(policy, batch, mask, ckpt: str) -> dict:
    """Step 2 straight on vs step 2 after reloading the step-1 checkpoint (adapters + optimizer state)."""
    from mcore_rl.checkpoint_io import load_dist_checkpoint, save_dist_checkpoint

    save_dist_checkpoint(ckpt, policy.model, policy.optimizer, overwrite=True)
    _step(policy, batch)
    straight = policy.logprobs(batch)
    load_dist_checkpoint(ckpt, policy.model, policy.optimizer)
    policy._sync_main_params()
    reloaded = policy.logprobs(batch)
    _step(policy, batch)
    return dict(straight=straight * mask, reloaded=reloaded * mask, resumed=policy.logprobs(batch) * mask)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--distributed-optimizer", action="store_true")
    a = ap.parse_args()
    init_distributed(1, 1, ep=a.ep)
    optim = OptimSettings(lr=1e-3, weight_decay=0.0, adam_beta2=0.999, clip_grad=0.0,
                          use_distributed_optimizer=a.distributed_optimizer)  # fmt: skip
    lora = LoraConfig(rank=RANK, alpha=ALPHA, target_modules=TARGETS)
    policy = Policy(a.hf, PolicyConfig(build=BuildConfig(ep=a.ep), optim=optim, token_budget=48, lora=lora))
    policy.load_hf(a.hf)
    base = {n: p.detach().clone() for n, p in policy.model.named_parameters() if not p.requires_grad}
    load_adapters(policy.model, fixed_adapters(policy.model))
    policy._sync_main_params()
    batch, mask = fixed_batch(policy.args.vocab_size)
    before = policy.logprobs(batch)
    stats = _step(policy, batch)
    after = policy.logprobs(batch)
    adapters = gather_adapters(policy.model)
    resume = _resume(policy, batch, mask, a.ckpt)
    changed = any(not torch.equal(p, base[n]) for n, p in policy.model.named_parameters() if n in base)
    from mcore_rl.distributed import all_ranks_any

    frozen_same = not all_ranks_any(changed)  # every rank's base weights (its own experts) bitwise unchanged

    from mcore_rl.rollout.local.engine import LocalEngine
    from mcore_rl.rollout.weight_sync.megatron_sync import sync_weights

    engine = LocalEngine(a.hf) if dist.get_rank() == 0 else None
    pre = engine_logprobs(engine, batch.tokens) if engine is not None else None
    sync_weights(policy, engine, version=1)
    if dist.get_rank() == 0:
        res = dict(
            before=before * mask,
            after=after * mask,
            grad_norm=stats["grad_norm"],
            adapters=adapters,
            **resume,
            frozen_same=frozen_same,
            engine_before=pre * mask,
            engine_after=engine_logprobs(engine, batch.tokens) * mask,
        )
        torch.save(res, a.out)
        engine.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
