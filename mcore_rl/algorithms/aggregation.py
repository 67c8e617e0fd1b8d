"""Loss aggregation as per-token weights.

Why weights: the trainer splits a batch into micro-batches (token budget) and data-parallel ranks, and Megatron
is configured to *sum* (not average) over both. If each token carries a weight w such that
    aggregated loss = sum_{all tokens} w * loss_token,
then every micro-batch contributes sum(w * loss_token) and the total is independent of the split. The weights
are computed once for the whole local batch; the only global facts they need (token, sequence and prompt
counts) are sums, obtained with the SUM reducer.

Modes (m = response mask, l = per-token loss, |y_i| = sum_t m_it, G(x) = responses of prompt x):
- token-mean:              sum m*l / sum m                                  (global token count)
- seq-mean-token-mean:     1/N_seq * sum_i (sum_t m*l / |y_i|)              (original GRPO)
- prompt-mean:             1/N_prompt * sum_x (sum_{i in G(x)} sum_t m*l / sum_{i in G(x)} |y_i|)   (DAPO, ScaleRL)
- seq-mean-token-sum-norm: sum m*l / (N_seq * L_max)                        (Dr.GRPO)
  We divide by N_seq * L_max (as TRL does, B * L_max), not by L_max alone (verl): the loss scale then does not
  grow with the batch size, while the denominator still ignores the actual response lengths.
N_seq and N_prompt count only sequences / prompts with at least one counted token, so sequences removed by
zero-variance filtering (mask zeroed or dropped) change no denominator.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from mcore_rl.algorithms.reduce import Reducer, identity_reduce, stack_sums


def group_inverse(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary (non-contiguous) group ids to 0..G-1; returns (inverse index [N], G)."""
    if group_ids.numel() == 0:
        return torch.zeros(0, dtype=torch.long, device=group_ids.device), 0
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    return inv, int(uniq.numel())


def _token_mean(m: Tensor, lens: Tensor, glen: Tensor, inv: Tensor, counts: Tensor, max_len: int | None) -> Tensor:
    return m / counts[0].clamp(min=1)


def _seq_mean_token_mean(m: Tensor, lens: Tensor, glen: Tensor, inv: Tensor, counts: Tensor,
                         max_len: int | None) -> Tensor:
    return m / lens.clamp(min=1)[:, None] / counts[1].clamp(min=1)


def _prompt_mean(m: Tensor, lens: Tensor, glen: Tensor, inv: Tensor, counts: Tensor, max_len: int | None) -> Tensor:
    return m / glen[inv].clamp(min=1)[:, None] / counts[2].clamp(min=1)


def _seq_mean_token_sum_norm(m: Tensor, lens: Tensor, glen: Tensor, inv: Tensor, counts: Tensor,
                             max_len: int | None) -> Tensor:
    if max_len is None or max_len <= 0:
        raise ValueError("loss_agg_mode=seq-mean-token-sum-norm needs max_response_len > 0 (the constant L_max)")
    return m / (float(max_len) * counts[1].clamp(min=1))


_AGGREGATORS: dict[str, Callable[..., Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "prompt-mean": _prompt_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}
AGG_MODES: tuple[str, ...] = tuple(_AGGREGATORS)


def aggregation_weights(mask: Tensor, group_ids: Tensor, mode: str, reduce: Reducer = identity_reduce,
                        max_len: int | None = None) -> Tensor:
    """Per-token weights [N, T] for the whole local batch; global counts come from `reduce` (one all-reduce).

    All responses of a prompt must be on this rank (prompt-mean needs the group's total length locally).
    """
    if mode not in _AGGREGATORS:
        raise ValueError(f"loss_agg_mode={mode!r} is not one of {list(AGG_MODES)}")
    if mask.dim() != 2 or group_ids.shape != mask.shape[:1]:
        raise ValueError(f"mask must be [N, T] and group_ids [N]; got {tuple(mask.shape)} and {tuple(group_ids.shape)}")
    m = (mask > 0).to(torch.float64)
    lens = m.sum(dim=1)
    inv, num_groups = group_inverse(group_ids)
    glen = torch.zeros(num_groups, dtype=torch.float64, device=m.device).index_add_(0, inv, lens)
    counts = reduce(stack_sums(m.sum(), (lens > 0).sum(), (glen > 0).sum(), device=m.device))
    w = _AGGREGATORS[mode](m, lens, glen, inv, counts, max_len)
    return w.to(mask.dtype if mask.is_floating_point() else torch.float32)


def aggregate(per_token: Tensor, mask: Tensor, group_ids: Tensor, mode: str, max_len: int | None = None) -> Tensor:
    """Reference aggregation in one process: sum(w * l). Used by tests and for logging."""
    w = aggregation_weights(mask, group_ids, mode, identity_reduce, max_len).to(per_token.dtype)
    return (w * torch.where(w != 0, per_token, torch.zeros_like(per_token))).sum()
