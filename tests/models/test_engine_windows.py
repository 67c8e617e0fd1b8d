"""The embedded engine's decode cache under sliding windows: prompts and responses run far past the window (8
tokens), in one continuous batch of mixed lengths (left padding, rows leaving early), and every sampled token's
log-prob equals a plain full forward of transformers' model (which applies the window itself) within 1e-4 (fp32).
Mistral (every layer windowed) and Qwen2 with `use_sliding_window` + `max_window_layers` (layer 1 of 2)."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.rollout.local.engine import LocalEngine
from mcore_rl.rollout.protocol import GenerationRequest, SamplingParams
from tests.rollout.conftest import forward_logprobs

pytestmark = pytest.mark.rollout
WINDOW = 8
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=512)
CONFIGS = {
    "mistral": lambda: __import__("transformers").MistralConfig(**SHAPE, sliding_window=WINDOW),
    "qwen2-layer1": lambda: __import__("transformers").Qwen2Config(**SHAPE, use_sliding_window=True,
                                                                   sliding_window=WINDOW, max_window_layers=1),
}


def _folder(root, name: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name]())
    with torch.no_grad():  # sharp attention, so a key outside the window would change the log-probs visibly
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(5.0)
    model.save_pretrained(root)
    return root, AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_engine_logprobs_past_the_window(name, tmp_path):
    folder, model = _folder(tmp_path, name)
    engine = LocalEngine(str(folder), seed=1)
    try:
        reqs = [GenerationRequest(list(range(3, 3 + n)), SamplingParams(temperature=1.0, max_new_tokens=m,
                                                                        ignore_eos=True))
                for n, m in ((5, 30), (20, 25), (3, 40), (12, 10))]
        samples = engine.generate(reqs)
    finally:
        engine.close()
    assert [len(s.output_ids) for s in samples] == [30, 25, 40, 10]
    for s in samples:
        ref = forward_logprobs(model, s.prompt_ids, s.output_ids, 1.0)
        assert (torch.tensor(s.output_logprobs) - ref).abs().max().item() < 1e-4, s.rid
    # the window matters here: the same tokens without it have other log-probs
    full = model.config.__class__(**{**model.config.to_dict(), "sliding_window": None, "layer_types": None,
                                     "use_sliding_window": False})
    from transformers import AutoModelForCausalLM

    unwindowed = AutoModelForCausalLM.from_config(full).eval()
    unwindowed.load_state_dict(model.state_dict())
    s = samples[2]
    diff = (forward_logprobs(unwindowed, s.prompt_ids, s.output_ids, 1.0) - torch.tensor(s.output_logprobs))
    assert diff.abs().max().item() > 1e-2
