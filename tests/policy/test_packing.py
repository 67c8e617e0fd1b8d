"""Packed micro-batches (`policy/packing.py`): rows concatenated without pad tokens through Megatron's THD layout
give the padded micro-batch's log-probs, entropy and gradients."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.policy.packing import pack_rows, row_lengths, scored_rows
from mcore_rl.policy.step import PolicyBatch, run_forward_backward
from tests.policy.conftest import loaded_policy


def test_pack_rows_layout():
    tokens = torch.arange(12).reshape(3, 4)
    mask = torch.tensor([[0, 1, 0, 0], [0, 1, 1, 1], [0, 0, 0, 0.0]])
    lengths = row_lengths(mask)
    assert lengths.tolist() == [2, 4, 1]  # up to the last scored token; an unscored row keeps its first token
    packed, pos, params, offsets = pack_rows(tokens, lengths)
    assert packed.tolist() == [[0, 1, 4, 5, 6, 7, 8]]
    assert pos.tolist() == [[0, 1, 0, 1, 2, 3, 0]]  # positions restart per sequence
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 2, 6, 7]
    assert params.cu_seqlens_q.dtype == torch.int32 and params.max_seqlen_q == 4
    hidden = torch.arange(7.0).reshape(7, 1, 1)
    sel = mask[:, 1:] > 0  # position t predicts token t + 1
    assert scored_rows(hidden, offsets, sel).flatten().tolist() == [0.0, 2.0, 3.0, 4.0]


@pytest.fixture(scope="module")
def policy(tiny_llama_dir):
    return loaded_policy(tiny_llama_dir, token_budget=96)


@pytest.mark.multiproc
def test_packed_equals_padded(policy, monkeypatch):
    """Through Megatron's schedule, fp32: log-probs within 1e-6, every parameter's gradient within 1e-6 relative;
    the packed forward really ran per-sequence attention on the unpadded tokens."""
    from mcore_rl.models import sdpa_attention

    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 512, (6, 20), generator=g)
    mask = torch.zeros(6, 20)
    for i, n in enumerate([20, 7, 13, 20, 9, 16]):
        mask[i, 4:n] = 1.0
    adv = torch.randn(6, 1, generator=g).expand(6, 20).contiguous()
    batch = PolicyBatch(tokens, mask, {"adv": adv})

    def loss_fn(mb, logp, ent):
        return -(mb.extras["adv"] * logp * mb.loss_mask).sum() - 0.1 * (ent * mb.loss_mask).sum(), {}

    seen: list[int] = []
    real_packed = sdpa_attention.SdpaAttention._packed

    def spy(self, query, *rest):
        seen.append(query.shape[0])
        return real_packed(self, query, *rest)

    monkeypatch.setattr(sdpa_attention.SdpaAttention, "_packed", spy)
    res = []
    for packed in (False, True):
        policy.model.zero_grad_buffer()
        mbs = policy.micro_batches(batch)
        run_forward_backward(policy.model, mbs, policy.args.vocab_size, loss_fn, 0.9, True, packed=packed)
        grads = torch.cat([p.main_grad.flatten().clone() for p in policy.model.parameters()])
        with torch.no_grad():
            outs = run_forward_backward(policy.model, mbs, policy.args.vocab_size, None, 0.9, packed=packed)
        res.append((torch.cat([o["logp"].flatten() for o in outs]), grads))
    (lp0, g0), (lp1, g1) = res
    # 2 micro-batches x 4 layers x (train + forward-only); each pack holds its rows' real tokens only
    assert len(seen) == 16 and sum(seen[:4]) < 4 * sum(mb.tokens.numel() for mb in mbs[:1])
    assert sorted(set(seen)) == sorted({int(row_lengths(mb.loss_mask).sum()) for mb in mbs})
    assert lp0.min().item() < -3.0 and (lp0 - lp1).abs().max().item() <= 1e-6
    assert ((g0 - g1).abs().max() / g0.abs().max()).item() <= 1e-6 and g0.abs().max().item() > 1e-2
