"""Frozen policies (reference, old-logit model): forward-only, no DDP wrapper, no gradient buffers, no optimizer,
and the same log-probs as the trainable policy built from the same weights."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.multiproc  # builds real Megatron modules (one gloo rank)


@pytest.fixture(scope="module")
def pair(tiny_llama_dir):
    from mcore_rl.distributed import init_distributed
    from mcore_rl.policy.policy import Policy, PolicyConfig

    init_distributed(1, 1)
    live = Policy(tiny_llama_dir, PolicyConfig(token_budget=64))
    frozen = Policy(tiny_llama_dir, PolicyConfig(token_budget=64), trainable=False)
    for pol in (live, frozen):
        pol.load_hf(tiny_llama_dir)
    return live, frozen


def grad_buffer_bytes(model) -> int:
    """Bytes of gradient storage a model holds: Megatron DDP's contiguous buffers (`main_grad` views into them)
    plus any plain `.grad`. What a frozen policy must not hold."""
    total = 0
    for buffers in (getattr(model, "buffers", None), getattr(model, "expert_parallel_buffers", None)):
        for buf in buffers if isinstance(buffers, list) else []:
            total += buf.grad_data.numel() * buf.grad_data.element_size()
    if total == 0:  # no DDP buffers: count per-parameter gradients
        for p in model.parameters():
            for g in (getattr(p, "main_grad", None), p.grad):
                if g is not None:
                    total += g.numel() * g.element_size()
    return total


def test_frozen_policy_holds_no_gradient_buffers(pair):
    from megatron.core.distributed import DistributedDataParallel

    live, frozen = pair
    assert isinstance(live.model, DistributedDataParallel) and not isinstance(
        frozen.model, DistributedDataParallel
    )
    assert frozen.optimizer is None and frozen.scheduler is None
    params = list(frozen.model.parameters())
    n = sum(p.numel() for p in params)
    assert n > 100_000 and not any(p.requires_grad for p in params)
    assert not any(hasattr(p, "main_grad") or p.grad is not None for p in params)
    assert grad_buffer_bytes(frozen.model) == 0
    saved = grad_buffer_bytes(live.model)
    # DDP's fp32 gradient buffer: 4 bytes per parameter (padded to its bucket alignment), gone when frozen
    assert 4 * n <= saved < 4 * n * 1.05, (saved, n)
    print(f"\nfrozen policy: {saved} bytes of DDP gradient buffers not allocated ({n} params)")


def test_frozen_log_probs_equal_the_trainable_policys(pair):
    from mcore_rl.policy.step import PolicyBatch

    live, frozen = pair
    g = torch.Generator().manual_seed(3)
    batch = PolicyBatch(torch.randint(0, 512, (4, 24), generator=g), torch.ones(4, 24))
    for temp in (1.0, 0.7):
        a, b = live.logprobs(batch, temp), frozen.logprobs(batch, temp)
        assert a.abs().sum().item() > 10  # real log-probs, not zeros
        assert (a - b).abs().max().item() <= 1e-6
