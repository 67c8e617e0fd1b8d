"""torchrun worker: at TP=2, the chunked LM head's log-probs, entropy and every parameter's gradient against the
unchunked (Megatron output layer + vocab-parallel log-softmax) path on the same weights and batch.

Usage: chunked_head_worker.py --hf DIR --out FILE
"""

from __future__ import annotations

import argparse

import torch

from mcore_rl.distributed import all_reduce, init_distributed
from mcore_rl.models.spec import BuildConfig
from mcore_rl.policy.policy import Policy, PolicyConfig
from mcore_rl.policy.step import PolicyBatch, run_forward_backward


def loss_fn(mb: PolicyBatch, logp: torch.Tensor, ent: torch.Tensor):
    return -(mb.extras["adv"] * logp * mb.loss_mask).sum() - 0.1 * (ent * mb.loss_mask).sum(), {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hf", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    init_distributed(2, 1)
    policy = Policy(a.hf, PolicyConfig(build=BuildConfig(tp=2), token_budget=64))
    policy.load_hf(a.hf)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, policy.args.vocab_size, (6, 16), generator=g)
    tokens[0, 5:] = policy.args.vocab_size - 1  # targets in the last rank's slice, next to the TP padding
    mask = torch.zeros(6, 16)
    mask[:, 4:] = 1.0
    batch = PolicyBatch(tokens, mask, {"adv": torch.randn(6, 1, generator=g).expand(6, 16).contiguous()})
    res = []
    for chunked in (False, True):
        policy.model.zero_grad_buffer()
        mbs = policy.micro_batches(batch)
        outs = run_forward_backward(
            policy.model, mbs, policy.args.vocab_size, loss_fn, 0.8, True, chunked_head=chunked
        )
        grads = torch.cat([p.main_grad.flatten().clone() for p in policy.model.parameters()])
        with torch.no_grad():
            fwd = run_forward_backward(
                policy.model, mbs, policy.args.vocab_size, None, 0.8, chunked_head=chunked
            )
        res.append((torch.cat([o["logp"].flatten() for o in fwd]), grads, len(outs)))
    (lp0, g0, n0), (lp1, g1, _) = res
    diffs = torch.tensor(
        [(lp0 - lp1).abs().max(), ((g0 - g1).abs().max() / g0.abs().max()), -lp0.min(), g0.abs().max()]
    )
    diffs = all_reduce(diffs, "max", None)
    vocab_rows = policy.gpt.shared_embedding_or_output_weight().shape[0]
    if torch.distributed.get_rank() == 0:
        torch.save(
            {
                "logp_diff": diffs[0].item(),
                "grad_rel_diff": diffs[1].item(),
                "neg_logp_max": diffs[2].item(),
                "grad_max": diffs[3].item(),
                "micro_batches": n0,
                "vocab_rows_per_rank": vocab_rows,
            },
            a.out,
        )
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
