"""The engine's bf16 decode path (rollout/local/decode_attention.py + index-free sampling) against references.

Bounds are set against a peer measured in the same test, not guessed: the engine's plain path (transformers'
SDPA) differs from a full-forward scoring of the same tokens by some amount in bf16 (KV-cached decode vs one
full forward round differently); the fast path must stay within 1.5x of that (+0.01 nat), under an absolute cap
of 0.5 nat on any token. fp32 must not change at all: there the fast path only skips index copies (bitwise).
"""

from __future__ import annotations

import pytest
import torch

from mcore_rl.rollout.local import decode_attention
from mcore_rl.rollout.local.engine import LocalEngine
from mcore_rl.rollout.protocol import GenerationRequest, SamplingParams
from tests.rollout.conftest import forward_logprobs

pytestmark = pytest.mark.rollout

PROMPTS = [list(range(3, 9)), list(range(20, 41)), [7, 5], list(range(60, 72))]  # mixed lengths: left padding


def _requests(**sp):
    return [GenerationRequest(p, SamplingParams(seed=i, ignore_eos=True, **sp)) for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_equals_sdpa_on_one_query(dtype):
    """GQA (9 query heads on 3 KV heads), a left-padded bool mask; fp32 to 1e-5, bf16 no worse than SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(0)
    b, h, kvh, L, d = 3, 9, 3, 17, 16
    q, k, v = (torch.randn(s, generator=g) for s in ((b, h, 1, d), (b, kvh, L, d), (b, kvh, L, d)))
    mask = torch.ones(b, 1, 1, L, dtype=torch.bool)
    mask[1, ..., :6] = False
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = h // kvh, True
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=d**-0.5)
    got, _ = decode_attention.decode_attention(module, *(t.to(dtype) for t in (q, k, v)), mask, scaling=d**-0.5)
    assert got.shape == ref.shape == (b, 1, h, d) and got.dtype == dtype
    if dtype == torch.float32:
        assert (got - ref).abs().max() < 1e-5
    else:
        peer, _ = sdpa_attention_forward(module, *(t.to(dtype) for t in (q, k, v)), mask, scaling=d**-0.5)
        assert (got.float() - ref).abs().max() <= 1.25 * (peer.float() - ref).abs().max() + 2**-8


def test_bf16_fast_decode_logprobs_bounded(tiny_dir, tiny_model):
    from transformers import AutoModelForCausalLM

    ref16 = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    eng = LocalEngine(str(tiny_dir), dtype="bf16")
    try:
        assert eng.model.config._attn_implementation == decode_attention.NAME  # bf16 default: fast path
        err = {}
        for fast in (False, True):
            eng.set_fast_decode(None if fast else False)
            samples = eng.generate(_requests(temperature=0.8, max_new_tokens=16))
            for ref, name in ((ref16, "bf16"), (tiny_model, "fp32")):
                err[fast, name] = torch.cat([(torch.tensor(s.output_logprobs) - forward_logprobs(
                    ref, s.prompt_ids, s.output_ids, 0.8)).abs() for s in samples])
        print({k: (round(v.max().item(), 4), round(v.mean().item(), 4)) for k, v in err.items()})
        for name in ("bf16", "fp32"):
            assert err[True, name].mean() <= 1.5 * err[False, name].mean() + 0.01
            assert err[True, name].max() < 0.5
    finally:
        eng.close()


def test_fp32_outputs_are_bitwise_the_plain_path(tiny_dir):
    eng = LocalEngine(str(tiny_dir))
    try:
        assert eng.model.config._attn_implementation == "sdpa"  # fp32 keeps transformers' SDPA
        fast = eng.generate(_requests(temperature=0.9, max_new_tokens=12))
        eng.set_fast_decode(False)
        plain = eng.generate(_requests(temperature=0.9, max_new_tokens=12))
    finally:
        eng.close()
    assert [s.output_ids for s in fast] == [s.output_ids for s in plain]
    assert [s.output_logprobs for s in fast] == [s.output_logprobs for s in plain]
