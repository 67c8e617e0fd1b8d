"""Chunked LM head + log-softmax (`policy/chunked_head.py`): the same numbers as the unchunked path, forward and
backward, and no [tokens, vocab] tensor kept for backward."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_rl.policy.chunked_head import chunk_rows, chunked_head_logprobs
from mcore_rl.policy.logprobs import vocab_parallel_logprobs
from mcore_rl.policy.step import PolicyBatch, run_forward_backward
from tests.policy.conftest import loaded_policy


def _head_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, hidden, v_pad, v = 45, 32, 104, 97  # 7 TP-padding rows beyond the true vocabulary
    h = torch.randn(n, hidden, generator=g)
    w = torch.randn(v_pad, hidden, generator=g) * 0.5  # logits of std ~3, as a trained LM's
    return (
        h,
        w,
        torch.randint(0, v, (n,), generator=g),
        v,
        torch.randn(n, generator=g),
        torch.randn(n, generator=g),
    )


ULPS2 = 2 * torch.finfo(torch.float32).eps  # two fp32 ulps, relative


def _rel(ref: torch.Tensor, got: torch.Tensor) -> float:
    return ((ref - got).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_chunked_equals_unchunked_forward_and_backward(temperature, with_entropy):
    h, w, targets, v, a, b = _head_case()
    grads = []
    for chunked in (False, True):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        if chunked:  # 8 tokens per chunk: six chunks, the last one partial
            lp, ent = chunked_head_logprobs(hh, ww, targets, v, temperature, with_entropy, rows=8)
        else:
            lp, ent = vocab_parallel_logprobs(hh @ ww.t(), targets, v, temperature, with_entropy)
        loss = (a * lp).sum() + ((b * ent).sum() if with_entropy else 0.0)
        loss.backward()
        grads.append((lp.detach(), ent, hh.grad, ww.grad))
    (lp0, ent0, gh0, gw0), (lp1, ent1, gh1, gw1) = grads
    assert lp0.min().item() < -4.0  # spread-out distributions: the comparison has teeth
    # log-probs down to ~-18 and entropies: the two paths sum in another order, and which order a CPU's kernels
    # take differs (AVX2 kernels: 1.9e-6 apart at |log p| ~ 16, where one fp32 ulp is 1.9e-6): 2 ulps
    assert (lp0 - lp1).abs().max().item() <= ULPS2 * max(1.0, lp0.abs().max().item())
    # gradients: sums over tokens in another order (per chunk), so 1e-6 relative to their largest entry
    assert _rel(gh0, gh1) <= 1e-6 and gh0.abs().max().item() > 0.5
    assert _rel(gw0, gw1) <= 1e-6 and gw0.abs().max().item() > 0.5
    assert gw1[97:].abs().max().item() == 0.0  # TP-padding rows get no gradient
    if with_entropy:
        assert (ent0 - ent1.detach()).abs().max().item() <= ULPS2 * max(1.0, lp0.abs().max().item())
    else:
        assert ent1 is None


def test_compiled_chunk_kernels_equal_eager(monkeypatch):
    """The compiled per-chunk kernels (used for real vocabularies, fp32 too) against the eager ones: 2 fp32 ulps of
    the log-probs' scale, gradients 1e-6 relative. They must have run compiled, or fallen back visibly where
    inductor has no C++ compiler."""
    from mcore_rl.compat import fused_ops
    from mcore_rl.policy import chunked_head

    h, w, targets, v, a, b = _head_case(1)
    out = []
    for floor in (10**9, 0):  # eager, then compiled (the vocabulary is above the floor)
        monkeypatch.setattr(chunked_head, "COMPILE_MIN_VOCAB", floor)
        monkeypatch.setattr(chunked_head, "COMPILE_MIN_HIDDEN", floor)
        before = dict(fused_ops.compiled_calls())
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = chunked_head_logprobs(hh, ww, targets, v, 0.8, True, rows=16)
        ((a * lp).sum() + (b * ent).sum()).backward()
        ran = {
            k: fused_ops.compiled_calls().get(k, 0) - before.get(k, 0)
            for k in ("_chunk_stats", "_chunk_grad")
        }
        out.append((lp.detach(), ent.detach(), hh.grad, ww.grad, ran))
    (lp0, e0, gh0, gw0, ran0), (lp1, e1, gh1, gw1, ran1) = out
    assert ran0 == {"_chunk_stats": 0, "_chunk_grad": 0}
    fell_back = fused_ops.fallbacks()
    assert all(ran1[k] == 3 or k in fell_back for k in ran1), (ran1, fell_back)  # 3 chunks each
    tol = ULPS2 * max(1.0, lp0.abs().max().item())  # per-ISA kernels sum in their own order (see above)
    assert (lp0 - lp1).abs().max().item() <= tol and (e0 - e1).abs().max().item() <= tol
    assert _rel(gh0, gh1) <= 1e-6 and _rel(gw0, gw1) <= 1e-6


def test_bf16_chunks_cast_inside_the_kernels_and_match_the_fp32_logits(monkeypatch):
    """bf16 hidden states and weight: each chunk's bf16 head output is cast to fp32 (and divided by T) inside the
    per-chunk kernels, compiled and eager alike; both give the log-probs of the same bf16 product's fp32 logits
    (`vocab_parallel_logprobs`), and the gradients come back in bf16."""
    from mcore_rl.compat import fused_ops

    h, w, targets, v, a, b = _head_case(2)
    h, w = h.bfloat16(), w.bfloat16()
    ref, _ = vocab_parallel_logprobs((h @ w.t()).float()[:, :v], targets, v, 0.8)
    out = []
    for compiled in (False, True):  # bf16 chunks compile whatever their size: the head's switch decides
        monkeypatch.setattr(fused_ops, "_HEAD_ENABLED", compiled)
        before = dict(fused_ops.compiled_calls())
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = chunked_head_logprobs(hh, ww, targets, v, 0.8, True, rows=16)
        ((a * lp).sum() + (b * ent).sum()).backward()
        assert hh.grad.dtype == ww.grad.dtype == torch.bfloat16
        ran = fused_ops.compiled_calls().get("_chunk_grad", 0) - before.get("_chunk_grad", 0)
        out.append((lp.detach(), hh.grad.float(), ww.grad.float(), ran))
    (lp0, gh0, gw0, ran0), (lp1, gh1, gw1, ran1) = out
    assert ran0 == 0 and (ran1 == 3 or "_chunk_grad" in fused_ops.fallbacks())
    tol = ULPS2 * max(1.0, ref.abs().max().item()) * 4  # fp32 arithmetic on the same logits
    assert (lp0 - ref).abs().max().item() <= tol and (lp1 - ref).abs().max().item() <= tol
    assert _rel(gh0, gh1) <= 1e-2 and _rel(gw0, gw1) <= 1e-2  # one bf16 rounding of each gradient apart at most


def test_chunk_rows_bound_the_logits_bytes():
    assert chunk_rows(49152) == 32 * 2**20 // (4 * 49152)  # 170 tokens of SmolLM2's vocabulary per chunk
    assert chunk_rows(100) > 1000 and chunk_rows(10**9) == 16
    from mcore_rl.policy.chunked_head import default_chunk_bytes

    # CUDA: ~1766 tokens of a 152k vocabulary per chunk (tiny chunks were 2.2x slower on an H200)
    assert chunk_rows(151936, default_chunk_bytes(torch.device("cuda"))) == 2**30 // (4 * 151936)
    assert default_chunk_bytes(torch.device("cpu")) == 32 * 2**20


def _saved_shapes(fn) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return shapes


@pytest.fixture(scope="module")
def policy(tiny_llama_dir):
    return loaded_policy(tiny_llama_dir, token_budget=96)


@pytest.mark.multiproc
def test_policy_chunked_head_matches_unchunked_and_keeps_no_logits(policy):
    """Through Megatron's schedule: log-probs within 2 fp32 ulps of their scale, every parameter's gradient 1e-6
    relative (fp32); the unchunked path saves a [scored tokens, vocab] tensor for backward, the chunked one nothing
    that large."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 512, (6, 20), generator=g)
    mask = torch.zeros(6, 20)
    mask[:, 5:] = 1.0
    adv = torch.randn(6, 1, generator=g)
    batch = PolicyBatch(tokens, mask, {"adv": adv.expand(6, 20).contiguous()})
    n_scored = int(mask[:, 1:].sum())
    vocab = policy.gpt.shared_embedding_or_output_weight().shape[0]

    def loss_fn(mb, logp, ent):
        return -(mb.extras["adv"] * logp * mb.loss_mask).sum() - 0.1 * (ent * mb.loss_mask).sum(), {}

    results = []
    for chunked in (False, True):
        policy.model.zero_grad_buffer()
        mbs = policy.micro_batches(batch)

        def step(mbs=mbs, chunked=chunked):
            run_forward_backward(
                policy.model, mbs, policy.args.vocab_size, loss_fn, 0.9, True, chunked_head=chunked
            )

        shapes = _saved_shapes(step)
        grads = torch.cat([p.main_grad.flatten().clone() for p in policy.model.parameters()])
        with torch.no_grad():
            outs = run_forward_backward(
                policy.model, mbs, policy.args.vocab_size, None, 0.9, chunked_head=chunked
            )
        logp = torch.cat([o["logp"].flatten() for o in outs])
        results.append((logp, grads, [sh for sh in shapes if len(sh) >= 2 and sh[-1] == vocab]))
    (lp0, g0, logits0), (lp1, g1, logits1) = results
    assert len(policy.micro_batches(batch)) == 2 and lp0.min().item() < -3.0
    assert (lp0 - lp1).abs().max().item() <= ULPS2 * max(1.0, lp0.abs().max().item())
    assert _rel(g0, g1) <= 1e-6 and g0.abs().max().item() > 1e-2
    # saved for backward with the vocabulary as last dim: the unchunked head keeps each micro-batch's logits
    # ([scored, 1, V] and the log-softmax's fp32 copies), the chunked one only per-token statistics
    assert max(math.prod(sh[:-1]) for sh in logits0) >= n_scored // 2  # two micro-batches
    assert logits1 == []


@pytest.mark.slow  # ~90 s (torchrun, 2 ranks); tests/multiproc TP=2 parity covers the chunked head by default
@pytest.mark.multiproc
def test_chunked_head_tp2_matches_unchunked(tmp_path):
    """TP=2 with a vocabulary that needs TP padding (509 -> 2 x 256 rows): per-rank vocabulary slices combined
    inside the chunked forward, d hidden all-reduced by Megatron's mapping: the same numbers as the unchunked
    vocab-parallel path (log-probs 1e-6, gradients 1e-6 relative)."""
    from pathlib import Path

    from tests.conftest import run_torchrun, save_random_hf, tiny_llama_config

    hf = save_random_hf(tmp_path / "hf", tiny_llama_config(vocab_size=509))
    out = tmp_path / "out.pt"
    worker = Path(__file__).parents[1] / "multiproc" / "chunked_head_worker.py"
    run_torchrun(2, worker, "--hf", str(hf), "--out", str(out))
    got = torch.load(out, weights_only=True)
    assert got["vocab_rows_per_rank"] * 2 > 509  # the last rank holds padding rows
    assert got["micro_batches"] >= 2 and got["neg_logp_max"] > 3.0 and got["grad_max"] > 1e-2
    assert got["logp_diff"] <= 1e-6
    assert got["grad_rel_diff"] <= 1e-6
