"""The reward model's forward: token-budget micro-batches through Megatron's (pipeline) schedule, the score head on
the final-norm hidden state of each row's last token.

Rows arrive already cut after the token HF scores (policy/score_model.py), so the scored position of a row is its
last one. As in the policy's scored-token path (`policy/step._scored_hidden`), the last stage runs the decoder with
`post_process` off to get the final-norm hidden states, then applies its head to the few positions that matter.
"""

from __future__ import annotations

import torch

from mcore_rl.policy.build import unwrap
from mcore_rl.policy.packing import can_pack, pack_rows
from mcore_rl.policy.step import PolicyBatch, split_micro_batches


def _padded(rows: list[list[int]]) -> PolicyBatch:
    """Right-padded tokens (pad id 0: causal attention keeps pad tokens out of the real ones), a mask of the real
    tokens (what `split_micro_batches` measures rows by) and each row's last position."""
    L = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1.0
    last = torch.tensor([len(r) - 1 for r in rows], dtype=torch.long)
    return PolicyBatch(tokens, mask, {"last": last})


def _last_hidden(model_chunk, gpt, tokens: torch.Tensor, last: torch.Tensor, packed: bool) -> torch.Tensor:
    """Final-norm hidden states [b, H] at each row's `last` position (padded rows, or packed without pads)."""
    gpt.post_process = False
    try:
        if packed:
            ptok, ppos, params, offsets = pack_rows(tokens, last + 1)
            hidden = model_chunk(ptok, ppos, None, packed_seq_params=params)  # [T, 1, H]
            return hidden[offsets + last, 0]
        pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        hidden = model_chunk(tokens, pos, None)  # [s, b, H]
    finally:
        gpt.post_process = True
    return hidden[last, torch.arange(tokens.shape[0], device=tokens.device)]


def score_micro_batches(model, rows: list[list[int]], token_budget: int, packed: bool = False
                        ) -> torch.Tensor | None:  # fmt: skip
    """Scores [len(rows), num_labels] (fp32, CPU) on the last pipeline stage, None on the others. Every rank of
    one model-parallel group must pass the same rows (an empty list runs nothing)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    gpt = unwrap(model)
    last_stage = gpt.post_process
    if not rows:
        return (
            gpt.output_layer.weight.new_zeros(0, gpt.output_layer.weight.shape[0]).float().cpu()
            if last_stage
            else None
        )
    model.eval()
    packed = packed and can_pack(gpt)
    batch = _padded(rows)
    mbs = split_micro_batches(batch, token_budget)
    device = next(model.parameters()).device

    def loss_func(scores: torch.Tensor):
        return scores.new_zeros(()), torch.tensor(1), {"scores": scores.float().cpu()}

    def forward_step(data_iterator, model_chunk):
        mb = next(data_iterator)
        tokens, last = mb.tokens.to(device), mb.extras["last"].to(device)
        if not last_stage:
            pos = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
            return model_chunk(tokens, pos, None), loss_func
        return gpt.output_layer.scores(_last_hidden(model_chunk, gpt, tokens, last, packed)), loss_func

    outs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(mbs),
        model=[model],
        num_microbatches=len(mbs),
        seq_length=mbs[0].tokens.shape[1],
        micro_batch_size=mbs[0].tokens.shape[0],
        forward_only=True,
    )
    if not last_stage:
        return None
    full = torch.zeros(len(rows), gpt.output_layer.weight.shape[0])
    for mb, out in zip(mbs, outs):
        full[mb.index] = out["scores"]
    return full
