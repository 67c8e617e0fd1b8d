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


def _reference_varlen(signature):
    """A CPU stand-in for `torch.nn.attention.varlen.varlen_attn` with the installed release's own signature: it
    computes the documented result (causal attention within each [cu[i], cu[i+1]) block) and refuses what the
    real kernel refuses (int32 bounds, [T, heads, dim] inputs, a causal switch, GQA only where declared)."""
    calls: list[dict] = []

    def fake(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        q, k, v, cu = a["query"], a["key"], a["value"], a["cu_seq_q"]
        assert cu.dtype == torch.int32 and a["cu_seq_k"] is cu and q.dim() == k.dim() == 3
        causal = a.get("window_size") == (-1, 0) if "window_size" in a else a.get("is_causal") is True
        assert causal, "called without its causal switch"
        if k.shape[1] != q.shape[1]:
            assert a.get("enable_gqa") is True, "K/V heads differ from the query heads without enable_gqa"
        bounds = cu.tolist()
        assert a["max_q"] == a["max_k"] == max(e - s for s, e in zip(bounds[:-1], bounds[1:]))
        out = torch.empty_like(q)
        for s, e in zip(bounds[:-1], bounds[1:]):
            qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))
            out[s:e] = torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=a.get("scale"), enable_gqa=k.shape[1] != q.shape[1]
            ).transpose(0, 1)
        calls.append({"tokens": q.shape[0], "gqa": "enable_gqa" in a and a["enable_gqa"]})
        return out

    fake.__signature__ = signature
    return fake, calls


def _signatures():
    """The installed release's signature, and the 2.10 one (`is_causal`, no `scale`, no `enable_gqa`)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    P = inspect.Parameter
    old = inspect.Signature([P(n, P.POSITIONAL_OR_KEYWORD) for n in
                             ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k")]
                            + [P("is_causal", P.KEYWORD_ONLY, default=False)])
    return {"installed": inspect.signature(varlen_attn), "torch-2.10": old}


@pytest.mark.parametrize("release", ["installed", "torch-2.10"])
def test_varlen_call_matches_per_sequence_attention(release):
    """`models/varlen.py` against a stand-in with each release's signature: same output as per-sequence SDPA for a
    GQA pack (4 query heads, 2 K/V heads); K/V heads are repeated where the release has no `enable_gqa`."""
    from mcore_rl.models import varlen

    fake, calls = _reference_varlen(_signatures()[release])
    impl = varlen.api_of(fake)
    assert impl is not None
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(11, 4, 8, generator=g), torch.randn(11, 2, 8, generator=g), torch.randn(11, 2, 8, generator=g)
    cu = torch.tensor([0, 3, 4, 11], dtype=torch.int32)
    out = varlen.packed_causal(q, k, v, cu, 7, 8**-0.5, impl=impl)
    ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), is_causal=True, enable_gqa=True
    ).transpose(0, 1) for s, e in ((0, 3), (3, 4), (4, 11))])
    assert (out - ref).abs().max().item() < 1e-6 and len(calls) == 1
    assert calls[0]["gqa"] == (release == "installed" and impl.gqa_keyword)


def test_varlen_applies_only_where_flash_computes_the_same():
    from mcore_rl.models import varlen

    q = torch.zeros(5, 2, 8, dtype=torch.bfloat16)
    assert not varlen.applies(q, 0.0, None, 8**-0.5)  # CPU: the per-sequence path
    if varlen.api() is None:
        pytest.skip("this PyTorch has no torch.nn.attention.varlen")
    cuda_q = torch.zeros(5, 2, 8, dtype=torch.bfloat16, device="meta")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        assert varlen.applies(cuda_q, 0.0, None, 8**-0.5)
        assert not varlen.applies(cuda_q.float(), 0.0, None, 8**-0.5)  # flash: fp16/bf16 only
        assert not varlen.applies(cuda_q, 0.1, None, 8**-0.5)  # attention dropout
        assert not varlen.applies(cuda_q, 0.0, 16, 8**-0.5)  # sliding window
        assert not varlen.applies(torch.zeros(5, 2, 512, dtype=torch.bfloat16, device="meta"), 0.0, None, 0.1)


@pytest.mark.multiproc
def test_packed_model_through_varlen_equals_padded(policy, monkeypatch):
    """SdpaAttention's varlen branch wired into the model (the stand-in for the CUDA kernel, CPU fp32): the packed
    forward's log-probs equal the padded forward's within 1e-6, one varlen call per layer and micro-batch."""
    from mcore_rl.models import varlen

    fake, calls = _reference_varlen(_signatures()["installed"])
    monkeypatch.setattr(varlen, "api", lambda: varlen.api_of(fake))
    monkeypatch.setattr(varlen, "applies", lambda *a: True)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 512, (5, 18), generator=g)
    mask = torch.zeros(5, 18)
    for i, n in enumerate([18, 6, 11, 15, 9]):
        mask[i, 3:n] = 1.0
    mbs = policy.micro_batches(PolicyBatch(tokens, mask))
    with torch.no_grad():
        lp = [torch.cat([o["logp"].flatten() for o in run_forward_backward(
            policy.model, mbs, policy.args.vocab_size, None, 1.0, packed=packed)]) for packed in (False, True)]
    assert len(calls) == len(mbs) * policy.args.num_layers and lp[0].min().item() < -3.0
    assert (lp[0] - lp[1]).abs().max().item() <= 1e-6


@pytest.mark.parametrize("exact_offsets", [False, True])
def test_packed_rope_is_megatrons_thd_rope_without_host_reads(exact_offsets, monkeypatch):
    """compat/rope.py on a pack from `pack_rows`: bitwise Megatron's `_apply_rotary_pos_emb_thd` (both of its freqs
    cases), with the sequence bounds never read on the host (a GPU would sync there in every layer)."""
    from megatron.core.models.common.embeddings import rope_utils

    from mcore_rl.compat import rope

    rope.install()
    from megatron.core.transformer import attention

    lengths = torch.tensor([5, 1, 9, 3])
    _, _, params, _ = pack_rows(torch.zeros(4, 9, dtype=torch.long), lengths)
    total = int(lengths.sum())
    g = torch.Generator().manual_seed(1)
    t = torch.randn(total, 3, 16, generator=g)
    freqs = torch.randn(total if exact_offsets else 9, 1, 1, 16, generator=g)

    class Cfg:
        apply_rope_fusion = rotary_interleaved = multi_latent_attention = False

    class OneRank:
        def size(self) -> int:
            return 1

        def rank(self) -> int:
            return 0

    want = rope_utils._apply_rotary_pos_emb_thd(t, params.cu_seqlens_q, freqs, cp_group=OneRank())
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("sequence bounds read on the host"))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("sequence bounds read on the host"))
    got = attention.apply_rotary_pos_emb(t, freqs, Cfg(), cu_seqlens=params.cu_seqlens_q, cp_group=OneRank())
    monkeypatch.undo()
    assert torch.equal(got, want) and not torch.equal(got, t)


def test_pack_rows_key_reaches_the_policy_config(monkeypatch):
    """trainer.pack_rows: auto packs on CUDA in bf16/fp16 where PyTorch has the varlen kernel, pads elsewhere;
    true/false win anywhere; a bad value is one config error naming the key."""
    from mcore_rl.config import ConfigError, load_config
    from mcore_rl.models import varlen
    from mcore_rl.trainer.setup import policy_config, resolve_pack_rows
    from tests.config.keyscan import compose

    assert resolve_pack_rows("auto", "bf16", cuda=False)[0] is False
    assert resolve_pack_rows("auto", "fp32", cuda=True)[0] is False  # flash attention: bf16/fp16 only
    assert resolve_pack_rows("true", "fp32", cuda=False) == (True, "trainer.pack_rows=true")
    assert resolve_pack_rows("false", "bf16", cuda=True)[0] is False
    monkeypatch.setattr(varlen, "api", lambda: None)
    assert "no torch.nn.attention.varlen" in resolve_pack_rows("auto", "bf16", cuda=True)[1]
    monkeypatch.setattr(varlen, "api", lambda: varlen.api_of(_reference_varlen(_signatures()["installed"])[0]))
    assert resolve_pack_rows("auto", "bf16", cuda=True)[0] is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert policy_config(load_config(compose(["model=tiny"])), "bf16").packed is False
    assert policy_config(load_config(compose(["model=tiny", "trainer.pack_rows=true"])), "fp32").packed is True
    with pytest.raises(ConfigError, match=r"trainer.pack_rows.*'sometimes'"):
        load_config(compose(["model=tiny", "trainer.pack_rows=sometimes"]))
