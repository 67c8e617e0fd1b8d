"""LM head + log-probs (+ entropy) in token chunks: the [tokens, vocab] fp32 logits are never held.

Why: over a 49k vocabulary the scored tokens' logits are the largest tensors of a train step (1k tokens: 200 MB
fp32, and the eager log-softmax keeps several such copies for backward). Here the head's matmul and the
log-softmax run chunk by chunk; forward keeps only per-token statistics (log Z and, for the entropy, E_p[x]),
and backward recomputes each chunk's logits from the hidden states (one extra head matmul on the scored tokens)
to form d logits = dlogp (onehot - p) - dH p (x - E_p[x]) and from it the hidden states' and the weight's
gradients. Same maths as `logprobs.vocab_parallel_logprobs` on `output_layer`'s logits; the tests hold it to
1e-6 in fp32, forward and backward.

Tensor parallelism: each rank holds a slice of the vocabulary rows of the weight. The max, the sum of exp, the
target's logit and sum p*x are all-reduced per chunk inside forward; backward needs no communication of its own:
p follows from the saved global log Z, and the hidden states' gradient (a partial sum per rank) is all-reduced by
Megatron's `copy_to_tensor_model_parallel_region` placed in front, as the column-parallel head does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mcore_rl.distributed import all_reduce

CHUNK_BYTES = 32 * 2**20  # fp32 logits per chunk on CPU (32 MiB: ~170 tokens over a 49k vocabulary)
# On CUDA a 32 MiB chunk is ~55 tokens of a 152k vocabulary: 150 chunks of small kernels made a 0.5B bf16 step
# 0.45x the unchunked speed on an H200 (docs/gpu_checks.md). A GPU holds far more: 1 GiB chunks keep the head to a
# handful of GEMM-sized chunks while still bounding the logits a step holds.
CUDA_CHUNK_BYTES = 2**30


def chunk_rows(n_vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's fp32 logits take about `chunk_bytes`."""
    return max(16, chunk_bytes // (4 * max(n_vocab, 1)))


def default_chunk_bytes(device: torch.device) -> int:
    return CUDA_CHUNK_BYTES if device.type == "cuda" else CHUNK_BYTES


def _logits(x: Tensor, temperature: float) -> Tensor:
    """The head's output chunk (the model's dtype) as fp32 logits over the temperature. Inside the per-chunk
    kernels, so that compiled, the cast and the division are part of their one loop: a separate `.float()` wrote
    and re-read a GiB of fp32 per CUDA chunk (~8% of a 0.5B bf16 step's GPU time on an H200)."""
    x = x.float()
    return x / temperature if temperature != 1.0 else x


def _chunk_stats(x: Tensor, local_t: Tensor, in_range: Tensor, with_entropy: bool, temperature: float = 1.0):
    """For x [c, v] (the head's output): max m, sum exp(x - m), the target's logit (0 off this rank's slice) and,
    for the entropy, sum exp(x - m) (x - m), of the fp32 logits x / T: the same max-shifted frame as
    `vocab_parallel_logprobs`."""
    x = _logits(x, temperature)
    m = x.amax(dim=-1)
    xs = x - m.unsqueeze(-1)
    e = xs.exp()
    s = e.sum(dim=-1)
    tgt = torch.gather(x, -1, local_t.unsqueeze(-1)).squeeze(-1)
    tgt = torch.where(in_range, tgt, torch.zeros_like(tgt))
    pdot = (e * xs).sum(dim=-1) if with_entropy else torch.zeros_like(s)
    return m, s, tgt, pdot


def _chunk_grad(
    x: Tensor,
    m: Tensor,
    log_s: Tensor,
    exs: Tensor,
    dlogp: Tensor,
    dent: Tensor,
    local_t: Tensor,
    in_range: Tensor,
    temperature: float,
    out_dtype: torch.dtype,
) -> Tensor:
    """d loss / d (head output) for one chunk, in the head's dtype: (dlogp (onehot - p) - dH p (x - E_p[x])) / T."""
    x = _logits(x, temperature)
    xs = x - m.unsqueeze(-1)
    p = (xs - log_s.unsqueeze(-1)).exp()
    g = torch.neg(p * (dlogp.unsqueeze(-1) + dent.unsqueeze(-1) * (xs - exs.unsqueeze(-1))))
    hit = torch.where(in_range, dlogp, torch.zeros_like(dlogp)).unsqueeze(-1)
    g = g.scatter_add(-1, local_t.unsqueeze(-1), hit)
    return (g * (1.0 / temperature)).to(out_dtype)


def _combine(m: Tensor, s: Tensor, tgt: Tensor, pdot: Tensor, group) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-rank vocabulary-slice statistics -> global ones: each rank's sums rescaled to the global max."""
    gm = all_reduce(m, "max", group)
    scale = (m - gm).exp()
    has = s > 0  # a rank whose slice is all TP padding contributes nothing (and m = -inf there)
    s_g = torch.where(has, s * scale, torch.zeros_like(s))
    p_g = torch.where(has, scale * (pdot + (m - gm) * s), torch.zeros_like(s))
    s_g, p_g, tgt = all_reduce(torch.stack([s_g, p_g, tgt]), "sum", group).unbind(0)
    return gm, s_g, tgt, p_g


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        h: Tensor,
        weight: Tensor,
        targets: Tensor,
        start: int,
        n_valid: int,
        temperature: float,
        with_entropy: bool,
        rows: int,
        group,
    ) -> tuple[Tensor, Tensor]:
        w = weight[:n_valid]
        local_t = targets - start
        in_range = (local_t >= 0) & (local_t < n_valid)
        local_t = local_t.clamp(0, max(n_valid - 1, 0))
        n = h.shape[0]
        stats = _kernels(h.dtype, n_valid, h.shape[-1])[0]
        m, s, tgt, pdot = (torch.zeros(n, dtype=torch.float32, device=h.device) for _ in range(4))
        if n_valid == 0:
            m.fill_(float("-inf"))
        for a in range(0, n if n_valid > 0 else 0, rows):
            b = min(n, a + rows)
            x = h[a:b] @ w.t()
            m[a:b], s[a:b], tgt[a:b], pdot[a:b] = stats(x, local_t[a:b], in_range[a:b], with_entropy, temperature)
        if group is not None:
            m, s, tgt, pdot = _combine(m, s, tgt, pdot, group)
        log_s = s.log()
        logp = (tgt - m) - log_s
        exs = pdot / s  # E_p[x] - max
        ent = log_s - exs
        ctx.save_for_backward(h, weight, local_t, in_range, m, log_s, exs)
        ctx.conf = (n_valid, temperature, rows)
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, dlogp: Tensor | None, dent: Tensor | None):
        h, weight, local_t, in_range, m, log_s, exs = ctx.saved_tensors
        n_valid, temperature, rows = ctx.conf
        dlogp = torch.zeros_like(m) if dlogp is None else dlogp.float()
        dent = torch.zeros_like(m) if dent is None else dent.float()
        w = weight[:n_valid]
        grad = _kernels(h.dtype, n_valid, h.shape[-1])[1]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gh = torch.zeros_like(h) if need_h else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for a in range(0, h.shape[0] if n_valid > 0 else 0, rows):
            b = min(h.shape[0], a + rows)
            x = h[a:b] @ w.t()
            g = grad(x, m[a:b], log_s[a:b], exs[a:b], dlogp[a:b], dent[a:b], local_t[a:b], in_range[a:b],
                     temperature, h.dtype)
            if need_h:
                gh[a:b] = g @ w
            if need_w and g.dtype == torch.float32:
                gw[:n_valid].addmm_(g.t(), h[a:b])
            elif need_w:
                gw[:n_valid] += g.t() @ h[a:b]
        return gh, (gw.to(weight.dtype) if need_w else None), None, None, None, None, None, None, None


# Compiled per-chunk kernels, measured (docs/performance.md, fp32, [170, 49152] chunks): stats 199 -> 16 ms,
# d logits 277 -> 69 ms. In fp32 the ~20 s of compile per process pays only for a real model's run: below this
# many vocabulary rows per rank, or below this hidden size (the tiny test models: hidden 64 with SmolLM2's 49k
# vocabulary, a few updates per process), the eager kernels are used; bf16/fp16 always compile, as before chunking.
COMPILE_MIN_VOCAB = 8192
COMPILE_MIN_HIDDEN = 256
_COMPILED: dict[str, object] = {}


def _kernels(dtype: torch.dtype, n_vocab: int, hidden: int):
    """(stats, grad) per-chunk functions: compiled (one fused loop each) unless `model.compile=false`; on CUDA too,
    where `auto` runs the layers' element-wise ops eager (trainer/setup.resolve_head_compile)."""
    from mcore_rl.compat.fused_ops import _compiled, head_compile_enabled

    small = n_vocab < COMPILE_MIN_VOCAB or hidden < COMPILE_MIN_HIDDEN
    if not head_compile_enabled() or (dtype == torch.float32 and small):
        return _chunk_stats, _chunk_grad
    if not _COMPILED:
        on = head_compile_enabled
        _COMPILED.update(stats=_compiled(_chunk_stats, on), grad=_compiled(_chunk_grad, on))
    return _COMPILED["stats"], _COMPILED["grad"]


def chunked_head_logprobs(
    h: Tensor,
    weight: Tensor,
    targets: Tensor,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    rows: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """log p(targets) [n] (and entropy [n]) of `h @ weight.T` for hidden states h [n, H], this TP rank's weight
    slice [V/tp, H]; rows beyond `vocab_size` (TP padding) are excluded. `rows`: tokens per chunk."""
    from mcore_rl.policy.logprobs import _tp_info

    tp_rank, tp_size, group = _tp_info()
    part = weight.shape[0]
    start = tp_rank * part
    n_valid = max(0, min(part, vocab_size - start))
    if tp_size > 1:
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        h = copy_to_tensor_model_parallel_region(h)  # identity forward, all-reduce of d h backward
    rows = rows or chunk_rows(n_valid, default_chunk_bytes(h.device))
    logp, ent = _ChunkedHead.apply(
        h, weight, targets, start, n_valid, temperature, with_entropy, rows, group if tp_size > 1 else None
    )
    return logp, (ent if with_entropy else None)
