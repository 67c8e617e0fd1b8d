"""The engine's fast decode path (rollout/local/decode_attention.py + index-free sampling) against references.

The fast path reorganises work without changing maths: GQA-packed SDPA (the query heads sharing a KV head as query
rows of one call) and sampling on whole tensors when every row shares a mode. So the engine's tokens and log-probs
must be bitwise those of the plain path in fp32 AND bf16 (same seeds), and the attention function must equal
transformers' SDPA exactly on a left-padded GQA batch. bf16 against a full-forward fp32 scoring is bounded by the
peer measured in the same test: transformers' own bf16 full forward scoring the same tokens (x1.5 + 0.01 nat).
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
    """GQA (9 query heads on 3 KV heads), a left-padded bool mask, K/V as slices of a larger buffer (the cache)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(0)
    b, h, kvh, L, d = 3, 9, 3, 17, 16
    q = torch.randn(b, 1, h, d, generator=g).to(dtype).transpose(1, 2)  # as LlamaAttention makes it
    k, v = (torch.randn(b, kvh, L + 7, d, generator=g).to(dtype)[:, :, :L] for _ in range(2))
    mask = torch.ones(b, 1, 1, L, dtype=torch.bool)
    mask[1, ..., :6] = False
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = h // kvh, True
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=d**-0.5)
    got, _ = decode_attention.decode_attention(module, q, k, v, mask, scaling=d**-0.5)
    assert got.shape == ref.shape == (b, 1, h, d) and got.dtype == dtype
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", ["float32", "bf16"])
def test_fast_decode_outputs_are_bitwise_the_plain_path(tiny_dir, dtype):
    eng = LocalEngine(str(tiny_dir), dtype=dtype)
    try:
        assert eng.model.config._attn_implementation == decode_attention.NAME  # the default
        fast = eng.generate(_requests(temperature=0.9, max_new_tokens=12))
        eng.set_fast_decode(False)
        assert eng.model.config._attn_implementation == "sdpa"
        plain = eng.generate(_requests(temperature=0.9, max_new_tokens=12))
    finally:
        eng.close()
    assert [s.output_ids for s in fast] == [s.output_ids for s in plain]
    assert [s.output_logprobs for s in fast] == [s.output_logprobs for s in plain]


def test_bf16_engine_logprobs_bounded_by_transformers_bf16(tiny_dir, tiny_model):
    from transformers import AutoModelForCausalLM

    ref16 = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    with LocalEngine(str(tiny_dir), dtype="bf16") as eng:
        samples = eng.generate(_requests(temperature=0.8, max_new_tokens=16))
    ours = torch.cat([(torch.tensor(s.output_logprobs) - forward_logprobs(tiny_model, s.prompt_ids, s.output_ids, 0.8))
                      .abs() for s in samples])
    peer = torch.cat([(forward_logprobs(ref16, s.prompt_ids, s.output_ids, 0.8) - forward_logprobs(
        tiny_model, s.prompt_ids, s.output_ids, 0.8)).abs() for s in samples])
    print(f"bf16 engine vs fp32 forward: max {ours.max():.4f} mean {ours.mean():.4f}; "
          f"transformers bf16 forward: max {peer.max():.4f} mean {peer.mean():.4f}")
    assert ours.mean() <= 1.5 * peer.mean() + 0.01 and ours.max() < 0.5
