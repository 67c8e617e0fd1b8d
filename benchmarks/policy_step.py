"""Megatron policy fwd+bwd tokens/s vs a `transformers` model of the same shape, side by side in one run.

    python benchmarks/policy_step.py [--model smollm2|tiny] [--batch 4] [--seq 256] [--iters 5]

Both see identical token batches and compute the same loss (sum of target log-probs); weights come from the same
HF folder, so the ratio compares implementations, not models. Prints both rates and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def bench(fn, iters: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    from mcore_rl.compat.malloc import tune_malloc

    tune_malloc()  # before torch starts threads
    import torch
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, LlamaConfig

    if a.model == "smollm2":
        from mcore_rl.models.smollm2 import materialize_smollm2

        folder = str(materialize_smollm2())
    else:
        folder = tempfile.mkdtemp()
        AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                                     num_attention_heads=4, num_key_value_heads=2,
                                                     vocab_size=8192)).save_pretrained(folder)

    from mcore_rl.distributed import init_distributed
    from mcore_rl.policy.policy import Policy, PolicyConfig
    from mcore_rl.policy.step import PolicyBatch

    init_distributed(1, 1)
    policy = Policy(folder, PolicyConfig(token_budget=a.batch * a.seq))
    policy.load_hf(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf.train()
    vocab = policy.args.vocab_size
    tokens = torch.randint(0, vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(tokens, dtype=torch.float32)
    batch = PolicyBatch(tokens, mask)
    n_tok = a.batch * a.seq

    def megatron_step():
        policy.model.zero_grad_buffer()
        policy.forward_backward(batch, lambda mb, logp, ent: (-(logp * mb.loss_mask).sum() / n_tok, {}))

    def hf_step():
        hf.zero_grad(set_to_none=True)
        logits = hf(tokens).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        (-(logp.sum()) / n_tok).backward()

    t_m = bench(megatron_step, a.iters)
    t_h = bench(hf_step, a.iters)
    print(f"model={a.model} batch={a.batch} seq={a.seq} threads={torch.get_num_threads()}")
    print(f"megatron_policy fwd+bwd: {n_tok / t_m:,.0f} tokens/s  (median {t_m:.3f} s/step)")
    print(f"transformers    fwd+bwd: {n_tok / t_h:,.0f} tokens/s  (median {t_h:.3f} s/step)")
    print(f"ratio megatron/transformers: {t_h / t_m:.2f}")


if __name__ == "__main__":
    main()
