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


def _nonzero_adapters(policy, seed: int = 11) -> dict[str, torch.Tensor]:
    from mcore_rl.policy.lora_state import gather_adapters, load_adapters

    g = torch.Generator().manual_seed(seed)
    full = {
        n: torch.randn(t.shape, generator=g) * 0.3 for n, t in sorted(gather_adapters(policy.model).items())
    }
    assert load_adapters(policy.model, full.__getitem__) == len(full)
    policy._sync_main_params()
    return full


def test_peft_and_merged_exports_reproduce_megatron_logits(lora, tiny_llama_dir, tmp_path):
    import json

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from mcore_rl.convert.cli import main
    from mcore_rl.convert.megatron_model import forward_logits
    from mcore_rl.policy.lora_state import save_adapter_folder

    full = _nonzero_adapters(lora)
    save_adapter_folder(full, tmp_path / "adapters", lora.cfg.lora, tiny_llama_dir)
    assert (
        main(
            [
                "--quiet",
                "lora-to-peft",
                "--adapters",
                str(tmp_path / "adapters"),
                "--out",
                str(tmp_path / "peft"),
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "--quiet",
                "lora-merge",
                "--adapters",
                str(tmp_path / "adapters"),
                "--out",
                str(tmp_path / "merged"),
            ]
        )
        == 0
    )
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert cfg["r"] == RANK and cfg["lora_alpha"] == 8.0
    assert cfg["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    peft_sd = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.self_attn.{}_proj.lora_{}.weight"
    assert torch.equal(peft_sd[key.format("q", "A")], peft_sd[key.format("v", "A")])  # qkv's A, shared
    h, kv = lora.args.hidden_size, lora.args.num_query_groups * lora.args.head_dim
    assert peft_sd[key.format("q", "B")].shape == (h, RANK) and peft_sd[key.format("k", "B")].shape == (
        kv,
        RANK,
    )

    tokens = torch.randint(0, lora.args.vocab_size, (3, 20), generator=torch.Generator().manual_seed(2))
    want = forward_logits(lora.model, tokens, lora.args.vocab_size)
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
        base_logits = plain(tokens).logits.float()
        peft_logits = PeftModel.from_pretrained(plain, tmp_path / "peft").eval()(tokens).logits.float()
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(tokens).logits.float()
    assert (base_logits - want).abs().max().item() > 0.1  # the adapters change the logits
    assert (peft_logits - want).abs().max().item() < 1e-4
    assert (merged - want).abs().max().item() < 1e-4


def test_adapter_folder_names_its_base_and_refuses_bad_input(lora, tiny_llama_dir, tmp_path):
    import json

    from mcore_rl.convert.cli import main
    from mcore_rl.policy.lora_state import base_model_hash, read_adapter_folder, save_adapter_folder

    full = _nonzero_adapters(lora, seed=3)
    save_adapter_folder(full, tmp_path / "a", lora.cfg.lora, tiny_llama_dir)
    tensors, cfg, meta = read_adapter_folder(tmp_path / "a")
    assert cfg == lora.cfg.lora and all(torch.equal(tensors[n], t) for n, t in full.items())
    assert meta["base_sha256"] == base_model_hash(tiny_llama_dir) and len(meta["base_sha256"]) == 64
    assert json.loads((tmp_path / "a" / "lora.json").read_text())["base_model"] == str(
        tiny_llama_dir.resolve()
    )
    assert main(["--quiet", "lora-to-peft", "--adapters", str(tmp_path), "--out", str(tmp_path / "p")]) == 2
    assert not (tmp_path / "p").exists()


def test_dropout_only_in_training_forwards(lora):
    from mcore_rl.policy.lora import adapted_linears

    _nonzero_adapters(lora, seed=5)
    name, lin = next(adapted_linears(lora.model))
    x = torch.randn(6, 2, lin.lora_A.shape[1], generator=torch.Generator().manual_seed(0))
    was = lin.training
    try:
        lin._lora.dropout = 0.5
        lin.eval()
        with torch.no_grad():
            clean = lin(x)[0]
            lin.train()
            torch.manual_seed(0)
            dropped = lin(x)[0]
            lin._lora.dropout = 0.0
            no_drop = lin(x)[0]
    finally:
        lin._lora.dropout = 0.0
        lin.train(was)
    assert torch.equal(no_drop, clean)  # eval ignores dropout; p=0 adds nothing random
    assert (dropped - clean).abs().max().item() > 1e-3  # training forwards drop adapter inputs
    base = torch.matmul(x, lin.weight.t())
    delta = torch.matmul(torch.matmul(x, lin.lora_A.t()), lin.lora_B.t()) * lin._lora.scale
    assert delta.abs().max().item() > 1e-2
    assert (clean - (base + delta)).abs().max().item() < 1e-5  # y = W x + alpha/r * B A x
