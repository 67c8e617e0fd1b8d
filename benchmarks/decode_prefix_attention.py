"""Decode attention over n per-row copies of a prompt's K/V (what the embedded engine keeps) against one shared
prefix per prompt plus each row's own suffix, merged by log-sum-exp: is sharing the prompt's K/V worth building?

    python benchmarks/decode_prefix_attention.py [--prompt-lens 47,400] [--suffix 30] [--prompts 16] [--n 4]

Why: the engine prefills a prompt once for its n samples but then copies its K/V into every sample's row
(kv_cache.py), so each decode step reads the prompt's K/V n times. Reading it once means one attention call per
prompt group (its n samples' query heads as the query rows) and one per row over the generated part, merged with
the two calls' log-sum-exps (`_scaled_dot_product_flash_attention_for_cpu` returns them). This times both over
SmolLM2's 30 layers (3 KV heads, 3 query heads each, head dim 64) for each prompt length, and checks that they
agree. CPU only.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from decode_gemms import best_ms  # benchmarks/decode_gemms.py (sys.path[0] is this folder)

LAYERS, KV_HEADS, Q_PER_KV, HEAD_DIM, SCALE = 30, 3, 3, 64, 0.125
flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def per_row(q, keys, values) -> list[torch.Tensor]:
    return [F.scaled_dot_product_attention(q, k, v, scale=SCALE) for k, v in zip(keys, values)]


def shared(q, prefix, suffix, groups: int, n: int) -> list[torch.Tensor]:
    """Rows of a group are adjacent (row = group * n + sample), as after the engine's prefill expansion."""
    b = q.shape[0]
    q_group = q.view(groups, n, KV_HEADS, Q_PER_KV, HEAD_DIM).transpose(1, 2).reshape(groups, KV_HEADS, -1, HEAD_DIM)
    out = []
    for (kp, vp), (ks, vs) in zip(prefix, suffix):
        o_p, lse_p = flash(q_group, kp, vp, 0.0, False, attn_mask=None, scale=SCALE)[:2]
        o_p = o_p.view(groups, KV_HEADS, n, Q_PER_KV, HEAD_DIM).transpose(1, 2).reshape(q.shape)
        lse_p = lse_p.view(groups, KV_HEADS, n, Q_PER_KV).transpose(1, 2).reshape(b, KV_HEADS, Q_PER_KV, 1)
        o_s, lse_s = flash(q, ks, vs, 0.0, False, attn_mask=None, scale=SCALE)[:2]
        lse_s = lse_s.unsqueeze(-1)
        top = torch.maximum(lse_p, lse_s)
        w_p, w_s = (lse_p - top).exp_(), (lse_s - top).exp_()
        out.append((o_p * w_p + o_s * w_s) / (w_p + w_s))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-lens", default="47,400")
    ap.add_argument("--suffix", type=int, default=30, help="generated tokens so far")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    a = ap.parse_args()
    g, n, ls = a.prompts, a.n, a.suffix
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q = rand(g * n, KV_HEADS, Q_PER_KV, HEAD_DIM)
    for lp in map(int, a.prompt_lens.split(",")):
        prefix = [(rand(g, KV_HEADS, lp, HEAD_DIM), rand(g, KV_HEADS, lp, HEAD_DIM)) for _ in range(LAYERS)]
        suffix = [(rand(g * n, KV_HEADS, ls, HEAD_DIM), rand(g * n, KV_HEADS, ls, HEAD_DIM)) for _ in range(LAYERS)]
        keys = [torch.cat([kp.repeat_interleave(n, 0), ks], 2) for (kp, _), (ks, _) in zip(prefix, suffix)]
        values = [torch.cat([vp.repeat_interleave(n, 0), vs], 2) for (_, vp), (_, vs) in zip(prefix, suffix)]
        diff = max((x - y).abs().max().item() for x, y in zip(per_row(q, keys, values), shared(q, prefix, suffix, g, n)))
        t_rows = best_ms(lambda: per_row(q, keys, values))  # noqa: B023 (called at once)
        t_shared = best_ms(lambda: shared(q, prefix, suffix, g, n))  # noqa: B023
        print(f"prompt {lp:5d} + {ls} generated, {g} x {n} rows, {LAYERS} layers: per-row copies {t_rows:6.1f} ms, "
              f"shared prefix {t_shared:6.1f} ms ({t_rows / t_shared:.2f}x), max difference {diff:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
