"""torchrun worker: train a TP/PP-sharded policy one step, sync weights into a local engine on rank 0, and compare
the engine's log-probs of a fixed sequence with the policy's. Usage: sync_worker.py --hf DIR --tp N --pp M --out F"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from mcore_rl.config.optim import OptimSettings
from mcore_rl.distributed import init_distributed
from mcore_rl.models.spec import BuildConfig
from mcore_rl.policy.policy import Policy, PolicyConfig
from mcore_rl.policy.step import PolicyBatch
from mcore_rl.rollout.weight_sync.megatron_sync import sync_weights
from mcore_rl.rollout.weight_sync.transports import SyncOptions
from tests.train_step import train_step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--mode", default="tensor")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    init_distributed(a.tp, a.pp)
    policy = Policy(a.hf, PolicyConfig(build=BuildConfig(tp=a.tp, pp=a.pp),
                                       optim=OptimSettings(lr=1e-2, weight_decay=0.01, adam_beta2=0.999,
                                                           clip_grad=0.0)))
    policy.load_hf(a.hf)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, policy.args.vocab_size, (3, 20), generator=g)
    mask = torch.ones(3, 20)
    batch = PolicyBatch(tokens, mask)
    train_step(policy, batch, lambda mb, lp, e: (-(lp * mb.loss_mask).sum() / 60, {}))  # weights now differ from HF
    ref = policy.logprobs(batch, temperature=0.8)
    engine = None
    if dist.get_rank() == 0:
        from mcore_rl.rollout.local.engine import LocalEngine

        engine = LocalEngine(a.hf, seed=0)
    def engine_logp() -> torch.Tensor:
        with torch.no_grad():
            logits = engine.model(tokens).logits.float() / 0.8
        return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)

    before = engine_logp() if engine is not None else None
    stats = sync_weights(policy, engine, version=7, mode=a.mode,
                         options=SyncOptions(sync_dir=a.out + ".sync", config_dir=a.hf))
    # the last PP stage holds the policy log-probs; ship them to rank 0
    if a.pp > 1:
        box = [ref]
        src = dist.get_world_size() - a.tp  # (pp=last, tp=0)
        dist.broadcast_object_list(box, src=src)
        ref = box[0]
    if dist.get_rank() == 0:
        got = engine_logp()
        torch.save({"diff": (got - ref[:, 1:]).abs().max().item(),
                    "diff_before": (before - ref[:, 1:]).abs().max().item(), "version": engine.weight_version,
                    "sync_gb": stats.get("sync_gb", 0.0)}, a.out)
        engine.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
