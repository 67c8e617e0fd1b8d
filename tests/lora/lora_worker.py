"""torchrun worker: a LoRA policy at some TP/PP from the HF base + fixed non-zero adapters; reports log-probs, one
Adam step's adapter grad norm, post-step log-probs, the gathered adapters, and (--sync) the embedded engine's
log-probs after a merged-weight sync. Usage: lora_worker.py --hf DIR --tp N --pp M --out FILE [--sync] [--sp]"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from mcore_rl.config.model import LoraConfig
from mcore_rl.config.optim import OptimSettings
from mcore_rl.distributed import init_distributed
from mcore_rl.models.spec import BuildConfig
from mcore_rl.policy.lora_state import gather_adapters, load_adapters
from mcore_rl.policy.policy import Policy, PolicyConfig
from tests.multiproc.launch import fixed_batch, loss_fn
from tests.train_step import train_step

RANK, ALPHA = 4, 8.0


def full_shape(a, name: str) -> tuple[int, int]:
    """Full (unsharded) shape of a canonical adapter tensor."""
    h, f = a.hidden_size, a.ffn_hidden_size
    out_in = {
        "linear_qkv": (h + 2 * a.num_query_groups * a.head_dim, h),
        "linear_proj": (h, h),
        "linear_fc1": (2 * f, h),
        "linear_fc2": (h, f),
    }
    module, which = name.rsplit(".", 2)[-2], name[-1]
    out, inp = out_in[module]
    return (RANK, inp) if which == "A" else (out, RANK)


def fixed_adapters(a):
    """The same full adapter values in every layout (seeded by name), large enough to move the log-probs."""
    import zlib

    def get(name: str) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        return torch.randn(full_shape(a, name), generator=g) * 0.3

    return get


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sync", action="store_true")
    ap.add_argument("--distributed-optimizer", action="store_true")
    ap.add_argument("--sp", action="store_true", help="sequence parallelism (TP > 1)")
    a = ap.parse_args()
    init_distributed(a.tp, a.pp)
    optim = OptimSettings(lr=1e-3, weight_decay=0.0, adam_beta2=0.999, clip_grad=0.0,
                          use_distributed_optimizer=a.distributed_optimizer)  # fmt: skip
    policy = Policy(
        a.hf,
        PolicyConfig(
            build=BuildConfig(tp=a.tp, pp=a.pp, sequence_parallel=a.sp),
            optim=optim,
            token_budget=48,
            lora=LoraConfig(rank=RANK, alpha=ALPHA),
        ),
    )
    policy.load_hf(a.hf)
    load_adapters(policy.model, fixed_adapters(policy.args))
    policy._sync_main_params()
    batch, mask = fixed_batch(policy.args.vocab_size)
    before = policy.logprobs(batch)
    from megatron.core import parallel_state as ps

    dp, dpr = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = [
        i for i in range(len(batch)) if i % dp == dpr
    ]  # each DP rank its rows; the summed loss is the same
    _, stats = train_step(policy, batch.select(rows), loss_fn)
    after = policy.logprobs(batch)
    adapters = gather_adapters(policy.model)
    res = {}
    if a.sync:
        res.update(_sync(policy, a.hf, batch, after, a))
    if a.pp > 1:  # the last stage holds the log-probs: ship them to rank 0
        box = [(before, after)]
        dist.broadcast_object_list(box, src=dist.get_world_size() - a.tp)
        before, after = box[0]
    if dist.get_rank() == 0:
        res.update(before=before * mask, after=after * mask, grad_norm=stats["grad_norm"], adapters=adapters,
                   sp_linears=_sp_linears(policy))  # fmt: skip
        torch.save(res, a.out)
    dist.barrier()
    dist.destroy_process_group()


def _sp_linears(policy) -> int:
    """Adapted linears running the sequence-parallel path, with their replicated factor marked for the TP sum."""
    from mcore_rl.policy.build import unwrap
    from mcore_rl.policy.lora import adapted_linears

    n = 0
    for _, m in adapted_linears(unwrap(policy.model)):
        dup = m.lora_A if m._lora.kind == "column" else m.lora_B
        n += int(m._lora.sequence_parallel and getattr(dup, "sequence_parallel", False))
    return n


def _sync(policy, hf: str, batch, policy_logp, a) -> dict:
    """Merged weights into rank 0's embedded engine; its log-probs vs the policy's (last stage's) log-probs."""
    from mcore_rl.rollout.weight_sync.megatron_sync import sync_weights
    from mcore_rl.rollout.weight_sync.transports import SyncOptions

    engine = None
    if dist.get_rank() == 0:
        from mcore_rl.rollout.local.engine import LocalEngine

        engine = LocalEngine(hf, seed=0)
    tokens = batch.tokens

    def engine_logp() -> torch.Tensor:
        with torch.no_grad():
            logits = engine.model(tokens).logits.float()
        return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)

    pre = engine_logp() if engine is not None else None
    stats = sync_weights(policy, engine, version=3, mode="tensor", options=SyncOptions(config_dir=hf))
    out = {}
    if engine is not None:
        out = {
            "engine_before": pre,
            "engine_after": engine_logp(),
            "sync_gb": stats["sync_gb"],
            "sync_peak_extra_mb": stats["sync_peak_extra_mb"],
            "sync_bound_mb": stats["sync_bound_mb"],
        }
        engine.close()
    return out


if __name__ == "__main__":
    main()
