"""Batched sampler: exact inverse-CDF draws, top-k / top-p support sets, untruncated log-probs."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.rollout.local.token_sampler import RowParams, sample_next

pytestmark = pytest.mark.rollout


def params(b, temperature=1.0, top_p=1.0, top_k=-1, seed=0):
    gens = [torch.Generator().manual_seed(seed + i) for i in range(b)]
    return RowParams.build([temperature] * b, [top_p] * b, [top_k] * b, gens)


def test_empirical_distribution_matches_tempered_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n, t = 20000, 0.8
    toks, lps = sample_next(logits.expand(n, -1).clone(), params(n, temperature=t))
    probs = torch.softmax(logits[0] / t, -1)
    freq = torch.bincount(toks, minlength=6).float() / n
    assert (freq - probs).abs().max() < 0.015  # ~4 sigma at n=20000
    assert torch.allclose(lps, torch.log(probs)[toks], atol=1e-6)


def test_top_k_top_p_restrict_support_but_not_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(1, 50) * 3
    n = 4000
    order = logits[0].argsort(descending=True)
    toks, lps = sample_next(logits.expand(n, -1).clone(), params(n, top_k=5))
    assert set(toks.tolist()) == set(order[:5].tolist())
    full = torch.log_softmax(logits[0], -1)
    assert torch.allclose(lps, full[toks], atol=1e-6)  # NOT renormalised over the top-k
    probs = torch.softmax(logits[0], -1)[order]
    nucleus = int((probs.cumsum(0) - probs <= 0.6).sum())  # SGLang's rule: keep while mass above <= p
    toks, _ = sample_next(logits.expand(n, -1).clone(), params(n, top_p=0.6))
    assert set(toks.tolist()) == set(order[:nucleus].tolist())


def test_greedy_rows_and_per_row_seeds():
    logits = torch.randn(4, 30)
    p = RowParams.build(
        [0.0, 1.0, 0.0, 1.0], [1.0] * 4, [-1] * 4, [torch.Generator().manual_seed(i) for i in range(4)]
    )
    toks, lps = sample_next(logits, p)
    assert toks[0] == logits[0].argmax() and toks[2] == logits[2].argmax()
    assert torch.allclose(lps[[0, 2]], torch.log_softmax(logits[[0, 2]], -1).max(-1).values)
    # row 1's draw depends only on its own generator: same result alone or in another batch
    alone, _ = sample_next(
        logits[1:2], RowParams.build([1.0], [1.0], [-1], [torch.Generator().manual_seed(1)])
    )
    assert alone.item() == toks[1].item()


@pytest.mark.parametrize("mode", [dict(temperature=0.0), dict(temperature=0.7), dict(top_p=0.9, top_k=20)])
def test_index_free_path_is_bitwise_the_indexed_one(mode):
    """Every row in one mode: the whole-tensor path picks the same tokens with the same log-probs, bit for bit."""
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(1)) * 4
    fast = sample_next(logits, params(6, seed=5, **mode), index_free=True)
    plain = sample_next(logits, params(6, seed=5, **mode), index_free=False)
    assert torch.equal(fast[0], plain[0]) and torch.equal(fast[1], plain[1])
