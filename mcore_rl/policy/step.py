"""Forward/backward over token-budget micro-batches through Megatron's pipeline schedule.

A `PolicyBatch` holds right-padded sequences; per-token side tensors (advantages, old log-probs, aggregation
weights, ...) ride along in `extras` and are sliced with the tokens. Right padding + causal attention means pad
tokens never influence real ones, so no attention mask is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from mcore_rl.policy.chunked_head import chunked_head_logprobs
from mcore_rl.policy.logprobs import vocab_parallel_logprobs
from mcore_rl.policy.packing import can_pack, pack_rows, row_lengths, scored_rows


@dataclass
class PolicyBatch:
    tokens: torch.Tensor  # [N, L] int64, right padded
    loss_mask: torch.Tensor  # [N, L] float: 1 where the token at that position is scored (response tokens)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # [N, L] or [N] tensors
    index: torch.Tensor | None = None  # rows of the parent batch (set on micro-batches; None on DP padding)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def lengths(self) -> torch.Tensor:
        """Index of the last scored/real token + 1 per row (trailing padding trimmed per micro-batch)."""
        real = (self.loss_mask > 0) | (torch.arange(self.tokens.shape[1]) == 0)
        idx = torch.arange(self.tokens.shape[1]).expand_as(self.tokens)
        return (torch.where(real, idx, torch.zeros_like(idx)).amax(dim=1) + 1).clamp(min=1)

    def select(self, rows: torch.Tensor | list[int], length: int | None = None) -> PolicyBatch:
        rows = torch.as_tensor(rows, dtype=torch.long)
        L = length or self.tokens.shape[1]

        def cut(t: torch.Tensor) -> torch.Tensor:
            t = t[rows]
            return t[:, :L] if t.dim() >= 2 else t

        index = rows if self.index is None else self.index[rows]
        return PolicyBatch(
            cut(self.tokens), cut(self.loss_mask), {k: cut(v) for k, v in self.extras.items()}, index
        )


def split_micro_batches(batch: PolicyBatch, token_budget: int, pad_to: int = 8) -> list[PolicyBatch]:
    """Greedy token-budget packing of length-sorted rows: rows * padded_max_len <= budget (at least 1 row).

    Rows are taken longest first, so each micro-batch holds rows of similar length and pads little (RL batches mix
    short and truncated answers: in arrival order a single long row pads its whole micro-batch). Each micro-batch
    records its rows' `index` in `batch`; losses are sums of per-token terms with global denominators, so the
    order of micro-batches does not change the result.
    """
    lengths = batch.lengths()
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    lengths = lengths.tolist()
    out: list[PolicyBatch] = []
    start = 0
    while start < len(order):
        end, cur_max = start, 0
        while end < len(order):
            m = max(cur_max, lengths[order[end]])
            m_pad = min(-(-m // pad_to) * pad_to, batch.tokens.shape[1])
            if end > start and (end - start + 1) * m_pad > token_budget:
                break
            cur_max, end = m, end + 1
        L = min(-(-cur_max // pad_to) * pad_to, batch.tokens.shape[1])
        out.append(batch.select(order[start:end], L))
        start = end
    return out


# loss callback: (micro-batch, logp [b, L], entropy [b, L] | None) -> (loss, metrics)
LossFn = Callable[[PolicyBatch, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, dict[str, float]]]


def _shifted_logprobs(
    logits: torch.Tensor, mb: PolicyBatch, vocab_size: int, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logp[:, t] = log p(tokens[t] | tokens[<t]); position 0 gets 0 (nothing predicts it)."""
    targets = mb.tokens[:, 1:]
    logp, ent = vocab_parallel_logprobs(logits[:, :-1], targets, vocab_size, temperature, with_entropy)
    zero = logp.new_zeros(logp.shape[0], 1)
    logp = torch.cat([zero, logp], dim=1)
    if ent is not None:
        ent = torch.cat([zero, ent], dim=1)
    return logp, ent


def _scatter_scored(values: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """[n] values at scored positions -> [b, L] (position t = token t; zeros elsewhere), differentiably."""
    b, L1 = sel.shape
    full = values.new_zeros(b, L1).masked_scatter(sel, values)
    return torch.cat([values.new_zeros(b, 1), full], dim=1)


def _scored_hidden(model_chunk, gpt, mb: PolicyBatch, pos: torch.Tensor, sel: torch.Tensor, packed: bool):
    """The final-norm hidden states [n, H] that predict the scored tokens (`sel` [b, L-1]): from the padded
    micro-batch, or from its rows packed without pad tokens (`packing.py`) where the model allows it."""
    packed = packed and can_pack(gpt)
    gpt.post_process = False
    try:
        if packed:
            tokens, ppos, params, offsets = pack_rows(mb.tokens, row_lengths(mb.loss_mask))
            return scored_rows(model_chunk(tokens, ppos, None, packed_seq_params=params), offsets, sel)
        hidden = model_chunk(mb.tokens, pos, None)  # [s, b, h] after the final norm
    finally:
        gpt.post_process = True
    return hidden.transpose(0, 1)[:, :-1][sel]


def _head_on_scored_tokens(model_chunk, mb: PolicyBatch, pos: torch.Tensor, chunked: bool, packed: bool = False):
    """Run the decoder, then the LM head only where a scored token is predicted.

    Prompt positions need no logits; skipping them saves most of the vocab-sized matmul and softmax work
    (prompts are often longer than answers). Returns (head output, sel [b, L-1]) or None when the fast path does
    not apply (not the last stage, or sequence parallel, whose hidden states are scattered). The head output is
    (hidden [n, H], weight [V/tp, H]) when `chunked` (`chunked_head.py` runs the head and the log-softmax in
    token chunks), else the logits [n, 1, V/tp] of Megatron's output layer.
    """
    from mcore_rl.policy.build import unwrap

    gpt = unwrap(model_chunk)
    if not gpt.post_process or gpt.config.sequence_parallel:
        return None
    sel = mb.loss_mask[:, 1:] > 0
    h = _scored_hidden(model_chunk, gpt, mb, pos, sel, packed)
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    dtype = gpt.output_layer.weight.dtype if weight is None else weight.dtype
    if getattr(gpt, "lm_head_fp32", False) and dtype != torch.float32:
        # fp32 copy of the (bf16) weight inside autograd: its gradient flows back to the bf16 parameter
        weight = (gpt.output_layer.weight if weight is None else weight).float()
        dtype = torch.float32
    if chunked:
        return (h.to(dtype), gpt.output_layer.weight if weight is None else weight), sel
    logits, _ = gpt.output_layer(h.unsqueeze(1).to(dtype), weight=weight)
    return logits, sel


def _scored_logprobs(
    out, mb: PolicyBatch, sel: torch.Tensor, vocab_size: int, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) [b, L] of the scored tokens from the head output of `_head_on_scored_tokens`."""
    targets = mb.tokens[:, 1:][sel]
    if isinstance(out, tuple):
        lp, en = chunked_head_logprobs(out[0], out[1], targets, vocab_size, temperature, with_entropy)
    else:
        lp, en = vocab_parallel_logprobs(out[:, 0], targets, vocab_size, temperature, with_entropy)
    return _scatter_scored(lp, sel), (_scatter_scored(en, sel) if en is not None else None)


def run_forward_backward(
    model,
    micro_batches: list[PolicyBatch],
    vocab_size: int,
    loss_fn: LossFn | None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    forward_only: bool = False,
    scored_only: bool = True,
    chunked_head: bool = True,
    packed: bool = False,
) -> list[dict]:
    """One pass of Megatron's schedule (1F1B under PP). Returns per-micro-batch outputs on the last stage.

    With `loss_fn=None` the pass is forward-only and each output holds {"logp": [b, L]}.
    `scored_only`: log-probs only where `loss_mask` is 1 (zeros elsewhere); the LM head skips other positions.
    `chunked_head`: with `scored_only`, the head and log-softmax run in token chunks (no [tokens, vocab] logits).
    `packed`: with `scored_only`, each micro-batch's rows run packed without pad tokens where the model allows.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = next(model.parameters()).device
    it = iter(micro_batches)

    def loss_func(mb: PolicyBatch, sel: torch.Tensor | None, logits: torch.Tensor):
        if sel is None:
            logp, ent = _shifted_logprobs(logits, mb, vocab_size, temperature, with_entropy)
        else:
            logp, ent = _scored_logprobs(logits, mb, sel, vocab_size, temperature, with_entropy)
        if loss_fn is None:
            return logp.new_zeros(()), torch.tensor(1), {"logp": logp.detach()}
        loss, metrics = loss_fn(mb, logp, ent)
        return loss, torch.tensor(1), metrics

    def forward_step(data_iterator, model_chunk):
        mb = next(data_iterator)
        mb = PolicyBatch(
            mb.tokens.to(device), mb.loss_mask.to(device), {k: v.to(device) for k, v in mb.extras.items()}
        )
        pos = torch.arange(mb.tokens.shape[1], device=device).unsqueeze(0).expand_as(mb.tokens)
        fast = _head_on_scored_tokens(model_chunk, mb, pos, chunked_head, packed) if scored_only else None
        if fast is not None:
            return fast[0], partial(loss_func, mb, fast[1])
        return model_chunk(mb.tokens, pos, None), partial(loss_func, mb, None)

    first = micro_batches[0].tokens.shape
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=it,
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=first[1],
        micro_batch_size=first[0],
        forward_only=forward_only or loss_fn is None,
    )
