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


@pytest.mark.parametrize("layout", ["out", "in"])
def test_route_on_cached_fp32_weights_is_bitwise_the_route(tiny_dir, tiny_alt_model, layout, monkeypatch):
    """bf16 through fp32 GEMMs (compat/bf16_matmul.py): the decode step and the LM head multiply cached fp32 copies
    of the weights (widened once per weight version) and must give exactly the tokens and log-probs of the route
    widening every product, before and after an in-place weight update (which must reach the copies)."""
    from mcore_rl.compat import bf16_matmul
    from mcore_rl.rollout.local import decode_forward, lm_head

    def both(eng) -> tuple[list, list]:
        cached = eng.generate(_requests(temperature=0.9, max_new_tokens=12))
        with monkeypatch.context() as m:
            m.setattr(decode_forward, "routed", lambda x: False)
            m.setattr(lm_head, "routed", lambda x: False)
            per_product = eng.generate(_requests(temperature=0.9, max_new_tokens=12))
        return cached, per_product

    bf16_matmul.enable()
    try:
        with LocalEngine(str(tiny_dir), dtype="bf16", weight_layout=layout) as eng:
            before = both(eng)
            layers = len(eng._batch.fused.layers)
            assert len(eng._batch.fused.wide) == 4 * layers and len(eng._batch.last_logits.wide) == 1
            eng.update_weights(tiny_alt_model.state_dict().items(), version=1)
            after = both(eng)
    finally:
        bf16_matmul.disable()
    for cached, per_product in (before, after):
        assert [s.output_ids for s in cached] == [s.output_ids for s in per_product]
        assert [s.output_logprobs for s in cached] == [s.output_logprobs for s in per_product]
    assert [s.output_ids for s in before[0]] != [s.output_ids for s in after[0]]  # the update reached the copies
