"""Single-process Megatron policy checks: log-probs vs plain PyTorch, entropy, CPU shim call sites, errors."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.models.base import family_for
from mcore_rl.models.spec import (
    BuildConfig,
    Fp8Config,
    resolve_impl,
    transformer_config_kwargs,
    validate_parallel,
)
from mcore_rl.policy.logprobs import reference_logprobs, vocab_parallel_logprobs
from tests.policy.conftest import loaded_policy
from tests.train_step import train_step

pytestmark = pytest.mark.multiproc  # builds real Megatron modules (one gloo rank)


@pytest.fixture(scope="module")
def policy(tiny_llama_dir):
    return loaded_policy(tiny_llama_dir, token_budget=64)


def test_logprobs_equal_plain_pytorch_reference(policy, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (5, 30), generator=g)
    mask = torch.ones(5, 30)
    from mcore_rl.policy.step import PolicyBatch

    for temp in (1.0, 0.7):
        got = policy.logprobs(PolicyBatch(tokens, mask), temperature=temp)
        with torch.no_grad():
            ref = reference_logprobs(hf(tokens).logits[:, :-1], tokens[:, 1:], temp)
        assert (got[:, 1:] - ref).abs().max().item() < 1e-5
        assert ref.std().item() > 0.3  # not near-uniform: the comparison has teeth


def test_cpu_shim_records_megatron_sites(policy):
    from mcore_rl.compat import cpu
    from mcore_rl.policy.step import PolicyBatch

    cpu.HITS.clear()
    b = PolicyBatch(torch.randint(0, 512, (2, 16)), torch.ones(2, 16))
    train_step(policy, b, lambda mb, logp, ent: (-(logp * mb.loss_mask).sum() / 32, {}))
    sites = {k: v for k, v in cpu.HITS.items() if "@ megatron/core/" in k}  # interceptions Megatron code made
    files = {k.split(" @ ")[1].rsplit(":", 1)[0] for k in sites}
    # the sites ENVIRONMENT.md lists for a train step on CPU
    assert "megatron/core/models/common/embeddings/rotary_pos_embedding.py" in files
    assert "megatron/core/optimizer/clip_grads.py" in files
    # our SDPA core attention replaces Megatron's local one (whose dropout forks the CUDA RNG tracker)
    assert "megatron/core/transformer/dot_product_attention.py" not in files
    assert "megatron/core/pipeline_parallel/schedules.py" in files
    assert all(v > 0 for v in sites.values())


def test_vocab_parallel_entropy_and_padding_match_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 40, generator=g) * 3
    targets = torch.randint(0, 37, (3, 7), generator=g)
    padded = torch.cat([logits[..., :37], torch.zeros(3, 7, 3)], dim=-1)  # 3 padded vocab rows
    logp, ent = vocab_parallel_logprobs(padded, targets, vocab_size=37, temperature=0.8, with_entropy=True)
    ref = reference_logprobs(logits[..., :37], targets, 0.8)
    p = torch.softmax(logits[..., :37] / 0.8, -1)
    ref_ent = -(p * p.log()).sum(-1)
    assert (logp - ref).abs().max() < 1e-5
    assert (ent - ref_ent).abs().max() < 1e-5
    # gradients flow through both outputs
    x = padded.clone().requires_grad_(True)
    lp, en = vocab_parallel_logprobs(x, targets, 37, 1.0, True)
    (lp.sum() + en.sum()).backward()
    assert x.grad[..., 37:].abs().max() == 0 and x.grad[..., :37].abs().max() > 0


def _args(heads=4, kv=2, layers=4):
    hf = dict(architectures=["LlamaForCausalLM"], num_hidden_layers=layers, hidden_size=64, intermediate_size=128,
              num_attention_heads=heads, num_key_value_heads=kv, vocab_size=100)
    return family_for(hf).args(hf)


def test_clear_errors_before_heavy_work():
    with pytest.raises(ValueError, match="parallel.tp=3 does not divide num_attention_heads=4"):
        validate_parallel(_args(), tp=3, pp=1)
    with pytest.raises(ValueError, match=r"does not divide num_query_groups \(KV heads\)=2"):
        validate_parallel(_args(heads=8, kv=2), tp=4, pp=1)
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tp\*pp=2\*2=4"):
        validate_parallel(_args(), tp=2, pp=2, world_size=6)
    with pytest.raises(RuntimeError, match="transformer_impl=transformer_engine needs Transformer Engine"):
        resolve_impl(BuildConfig(transformer_impl="transformer_engine"))
    with pytest.raises(RuntimeError, match="fp8.enabled=true needs Transformer Engine"):
        resolve_impl(BuildConfig(fp8=Fp8Config(enabled=True)))
    with pytest.raises(ValueError, match="unsupported architecture.*supported: LlamaForCausalLM"):
        family_for({"architectures": ["GPT2LMHeadModel"]})


def test_fp8_settings_map_to_transformer_config_fields():
    kw = transformer_config_kwargs(_args(), BuildConfig(dtype="bf16", fp8=Fp8Config(
        enabled=True, format="e4m3", recipe="blockwise", amax_history_len=16, amax_compute_algo="most_recent",
        margin=1)))
    assert (kw["fp8"], kw["fp8_recipe"], kw["fp8_amax_history_len"]) == ("e4m3", "blockwise", 16)
    assert (kw["fp8_amax_compute_algo"], kw["fp8_margin"], kw["bf16"]) == ("most_recent", 1, True)
    assert transformer_config_kwargs(_args(), BuildConfig())["fp8"] is None
    with pytest.raises(ValueError, match="model.fp8.recipe='nope'"):
        transformer_config_kwargs(_args(), BuildConfig(fp8=Fp8Config(enabled=True, recipe="nope")))
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(**transformer_config_kwargs(_args(), BuildConfig()))
    assert cfg.num_query_groups == 2 and cfg.gated_linear_unit and cfg.normalization == "RMSNorm"


def test_length_sorted_micro_batches_cut_padding_and_keep_row_order(policy):
    from mcore_rl.policy.step import PolicyBatch, split_micro_batches

    g = torch.Generator().manual_seed(2)
    lengths = [40, 9, 33, 12, 38, 10, 35, 8]  # long and short rows interleaved, as RL answers arrive
    tokens = torch.randint(0, 512, (len(lengths), 40), generator=g)
    mask = torch.zeros(len(lengths), 40)
    for i, n in enumerate(lengths):
        mask[i, 1:n] = 1.0
    batch = PolicyBatch(tokens, mask)
    mbs = split_micro_batches(batch, token_budget=96)
    assert sorted(int(i) for mb in mbs for i in mb.index) == list(range(len(lengths)))
    padded = sum(mb.tokens.numel() for mb in mbs)
    # arrival-order packing would pad every short row to its long neighbour (~2 rows of 40 per micro-batch)
    assert padded <= 0.7 * len(lengths) * 40, padded
    got = policy.logprobs(batch)  # token_budget=64 in the fixture: several micro-batches, reassembled by index
    budget, policy.cfg.token_budget = policy.cfg.token_budget, 10_000
    try:
        whole = policy.logprobs(batch)  # one micro-batch (weights may have moved in earlier tests: same policy)
    finally:
        policy.cfg.token_budget = budget
    m = mask > 0
    assert (got - whole).abs()[m].max().item() < 1e-5
    assert (got[~m] == 0).all() and whole[m].std() > 0.3


def test_cached_rope_is_bitwise_megatron_and_computes_cos_once(policy, monkeypatch):
    from types import SimpleNamespace

    from megatron.core.transformer import attention

    from mcore_rl.compat import fused_ops, rope

    assert attention.apply_rotary_pos_emb.__wrapped__ is not None  # installed by the local layer spec
    cfg = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)
    g = torch.Generator().manual_seed(3)
    freqs = torch.randn(24, 1, 1, 16, generator=g)
    calls = []
    real_cos = torch.cos
    monkeypatch.setattr(torch, "cos", lambda x: calls.append(1) or real_cos(x))
    rope._CACHE.clear()
    inputs = [torch.randn(24, 2, 4, 16, generator=g).to(dt) for dt in (torch.float32, torch.bfloat16) for _ in range(3)]
    got = [attention.apply_rotary_pos_emb(t, freqs, cfg) for t in inputs]  # 3 "layers" share freqs, per dtype
    assert len(calls) == 2  # cos once per dtype, not per layer
    for t, out in zip(inputs, got):
        megatron = attention.apply_rotary_pos_emb.__wrapped__(t, freqs, cfg, cp_group=object())
        if t.dtype == torch.float32:
            assert torch.equal(out, megatron)
        else:  # bf16 goes through the compiled fused_ops.rope: the same formula rounded once, not per op
            exact = attention.apply_rotary_pos_emb.__wrapped__(t.float(), freqs, cfg, cp_group=object())
            err, err_megatron = (out.float() - exact).abs().max(), (megatron.float() - exact).abs().max()
            assert err <= err_megatron + 2**-8 * exact.abs().max()
    monkeypatch.setattr(fused_ops, "_ENABLED", False)  # model.compile=false: bitwise Megatron in bf16 as well
    t = inputs[-1]
    assert torch.equal(attention.apply_rotary_pos_emb(t, freqs, cfg),
                       attention.apply_rotary_pos_emb.__wrapped__(t, freqs, cfg, cp_group=object()))
