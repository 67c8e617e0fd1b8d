"""Per-token log-probs and entropy from vocab-parallel logits, in FP32.

Why our own instead of `vocab_parallel_cross_entropy`: that kernel overwrites its input in place (so the logits
cannot also feed the entropy) and knows nothing of padded vocab rows or sampling temperature. Each TP rank holds a
slice of the vocabulary; the max is all-reduced without gradient, the sums with Megatron's
`reduce_from_tensor_model_parallel_region` (all-reduce forward, identity backward), which is exactly the
gradient of a sum whose terms live on different ranks.
"""

from __future__ import annotations

import torch

from mcore_rl.distributed import all_reduce


def _tp_info() -> tuple[int, int, object | None]:
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                    ps.get_tensor_model_parallel_group())
    except ImportError:
        pass
    return 0, 1, None


def _logprobs_one_rank(logits: torch.Tensor, targets: torch.Tensor, n_valid: int, temperature: float,
                       with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Whole vocabulary on this rank, compiled: one fused pass over the (bf16) logits forward and one backward.

    Eager, the same maths materialises [tokens, vocab] fp32 tensors five times (cast, shift, exp, the entropy
    product, and the backward's softmax); over a 49k vocab that is ~1 GB of memory traffic per 1k tokens.
    """
    x = logits[..., :n_valid].float()
    if temperature != 1.0:
        x = x / temperature
    log_z = torch.logsumexp(x, dim=-1)
    logp = torch.gather(x, -1, targets.unsqueeze(-1)).squeeze(-1) - log_z
    entropy = None
    if with_entropy:
        entropy = log_z - (torch.softmax(x, dim=-1) * x).sum(dim=-1)
    return logp, entropy


_fused_one_rank = None


def _fused_logprobs():
    global _fused_one_rank
    if _fused_one_rank is None:
        from mcore_rl.compat.fused_ops import _compiled, head_compile_enabled

        _fused_one_rank = _compiled(_logprobs_one_rank, head_compile_enabled)
    return _fused_one_rank


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) and (optionally) entropy for logits [..., V/tp] holding this TP rank's vocab slice.

    `vocab_size` is the true vocabulary; rows beyond it (TP padding) are excluded from the softmax.
    `temperature` divides the logits first, matching the rollout engine's (SGLang's) log-prob convention.
    """
    tp_rank, tp_size, group = _tp_info()
    if tp_size == 1 and logits.dtype != torch.float32 and logits.shape[-1] > 0:
        from mcore_rl.compat.fused_ops import head_compile_enabled

        if head_compile_enabled():  # bf16/fp16 logits; fp32 (exactness tests) keeps the eager path below
            return _fused_logprobs()(logits, targets, min(vocab_size, logits.shape[-1]), temperature, with_entropy)
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    part = logits.shape[-1]
    start = tp_rank * part
    n_valid = max(0, min(part, vocab_size - start))
    if n_valid < part:
        logits = logits[..., :n_valid] if n_valid > 0 else logits[..., :0]
    if tp_size > 1:
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as allsum

        local_max = logits.detach().amax(dim=-1) if n_valid > 0 else torch.full(
            logits.shape[:-1], float("-inf"), device=logits.device)
        global_max = all_reduce(local_max, "max", group)
    else:
        allsum = None  # type: ignore[assignment]
        global_max = logits.detach().amax(dim=-1)
    shifted = logits - global_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = exp.sum(dim=-1)
    local_t = targets - start
    in_range = (local_t >= 0) & (local_t < n_valid)
    idx = local_t.clamp(0, max(n_valid - 1, 0)).unsqueeze(-1)
    tgt = torch.gather(shifted, -1, idx).squeeze(-1) if n_valid > 0 else torch.zeros_like(sum_exp)
    tgt = torch.where(in_range, tgt, torch.zeros_like(tgt))
    if allsum is not None:
        sum_exp = allsum(sum_exp)
        tgt = allsum(tgt)
    log_z = sum_exp.log()
    logp = tgt - log_z
    entropy = None
    if with_entropy:
        # H = log Z - sum_v p_v * shifted_v  (all in the max-shifted frame)
        p_dot = (exp * shifted).sum(dim=-1)
        if allsum is not None:
            p_dot = allsum(p_dot)
        entropy = log_z - p_dot / sum_exp
    return logp, entropy


def reference_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Plain PyTorch reference on full logits (tests compare the parallel path against it)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return torch.gather(logp, -1, targets.unsqueeze(-1)).squeeze(-1)
