"""The engine in bf16: its log-probs against full-forward scoring, and the index-free sampling path bitwise.

Index-free sampling (token_sampler.py) works on whole tensors when every row shares a mode, so the engine's tokens
and log-probs must be bitwise those of the boolean-indexed path in fp32 AND bf16 (same seeds). bf16 against a
full-forward fp32 scoring is bounded by the peer measured in the same test: transformers' own bf16 full forward
scoring the same tokens (x1.5 + 0.01 nat; KV-cached decode and one full forward round differently).
"""

from __future__ import annotations

import pytest
import torch

from mcore_rl.rollout.local.engine import LocalEngine
from mcore_rl.rollout.protocol import GenerationRequest, SamplingParams
from tests.rollout.conftest import forward_logprobs

pytestmark = pytest.mark.rollout

PROMPTS = [list(range(3, 9)), list(range(20, 41)), [7, 5], list(range(60, 72))]  # mixed lengths: left padding


def _requests(**sp):
    return [GenerationRequest(p, SamplingParams(seed=i, ignore_eos=True, **sp)) for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("dtype", ["float32", "bf16"])
def test_index_free_sampling_is_bitwise_the_plain_path(tiny_dir, dtype):
    eng = LocalEngine(str(tiny_dir), dtype=dtype)
    try:
        fast = eng.generate(_requests(temperature=0.9, max_new_tokens=12))
        eng.set_fast_decode(sampling=False)
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
