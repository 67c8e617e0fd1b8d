"""One-rank LoRA policy: only adapters train, adapters off (or B = 0) is the base model exactly, merged weights
reproduce the adapted policy, adapter folders round-trip."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.config.model import LoraConfig
from mcore_rl.policy.step import PolicyBatch
from tests.train_step import train_step

pytestmark = pytest.mark.multiproc  # builds real Megatron modules (one gloo rank)
RANK = 4


def _policy(hf, lora: LoraConfig | None):
    from mcore_rl.config.optim import OptimSettings
    from mcore_rl.distributed import init_distributed
    from mcore_rl.policy.policy import Policy, PolicyConfig

    init_distributed(1, 1)
    cfg = PolicyConfig(token_budget=64, optim=OptimSettings(lr=1e-2, weight_decay=0.1, clip_grad=0.0))
    if lora is not None:
        cfg.lora = lora
    pol = Policy(hf, cfg)
    pol.load_hf(hf)
    return pol


@pytest.fixture(scope="module")
def base(tiny_llama_dir):
    return _policy(tiny_llama_dir, None)


@pytest.fixture(scope="module")
def lora(tiny_llama_dir):
    return _policy(tiny_llama_dir, LoraConfig(rank=RANK, alpha=8.0))


def _batch(vocab: int, n: int = 4, length: int = 24) -> PolicyBatch:
    g = torch.Generator().manual_seed(5)
    return PolicyBatch(torch.randint(0, vocab, (n, length), generator=g), torch.ones(n, length))


def _loss(mb, logp, ent):
    return -(logp * mb.loss_mask).sum() / 96, {}


def test_only_adapters_train(lora, base):
    from mcore_rl.policy.lora import adapted_linears, trainable_parameters

    a = lora.args
    linears = dict(adapted_linears(lora.model))
    assert len(linears) == 4 * a.num_layers
    trainable, total = trainable_parameters(lora.model)
    # per layer: qkv r*(h + qkv_out), proj r*(h + h), fc1 r*(h + 2*ffn), fc2 r*(ffn + h)
    h, f, qkv_out = a.hidden_size, a.ffn_hidden_size, a.hidden_size + 2 * a.num_query_groups * a.head_dim
    per_layer = RANK * ((h + qkv_out) + 2 * h + (h + 2 * f) + (f + h))
    assert trainable == per_layer * a.num_layers
    assert total - trainable == sum(p.numel() for p in base.model.parameters())
    named = dict(lora.model.named_parameters())
    assert all(p.requires_grad == (n.endswith(("lora_A", "lora_B"))) for n, p in named.items())
    # DDP's gradient buffers and the optimizer state hold the adapters only
    buffers = sum(b.grad_data.numel() for b in lora.model.buffers)
    assert buffers >= trainable and buffers < trainable + 64 * len(lora.model.buffers)  # bucket padding only
    opt_params = [p for g in lora.optimizer.param_groups for p in g["params"]]
    assert sum(p.numel() for p in opt_params) == trainable
    for _, lin in linears.items():  # B starts at zero, A does not
        assert lin.lora_B.abs().max().item() == 0 and lin.lora_A.abs().max().item() > 0


def test_zero_b_and_disabled_adapters_are_the_base_model(lora, base):
    from mcore_rl.policy.lora import BasePolicyView, adapted_linears

    batch = _batch(lora.args.vocab_size)
    want = base.logprobs(batch)
    assert torch.equal(lora.logprobs(batch), want)  # B = 0: the adapter adds exactly 0
    frozen = {n: p.detach().clone() for n, p in lora.gpt.named_parameters() if not p.requires_grad}
    for _ in range(2):
        lora.zero_grad()
        _, stats = train_step(lora, batch, _loss)
    assert stats["grad_norm"] > 0
    moved = lora.logprobs(batch)
    assert (moved - want).abs().max().item() > 1e-2  # the adapters learned something
    assert max(lin.lora_B.abs().max().item() for _, lin in adapted_linears(lora.model)) > 0
    for n, p in lora.gpt.named_parameters():  # weight decay and Adam never touched a frozen weight
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    assert torch.equal(BasePolicyView(lora).logprobs(batch), want)
    assert torch.equal(lora.logprobs(batch), moved)  # re-enabled after the reference pass
