"""examples/reward_model/fit_probe_rm.py makes the reward model docs/rewards.md trains on: its head, fitted on
SmolLM2's last hidden state of rendered (prompt, response) pairs, saved as an HF LlamaForSequenceClassification
folder, must be scored by transformers as exactly x @ w (the feature the fit saw is the token HF scores)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.conftest import REPO


def _example():
    spec = importlib.util.spec_from_file_location(
        "fit_probe_rm", REPO / "examples/reward_model/fit_probe_rm.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow  # SmolLM2 forwards: ~30-60 s on 2 cores
def test_the_fitted_head_is_what_transformers_scores(smollm2_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForSequenceClassification

    ex = _example()
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    pairs = [
        ("What is 2 + 3?", "5"),
        ("What is 2 + 3?", "It is 7."),
        ("What is 9 + 9?", "18"),
        ("What is 9 + 9?", "The answer is 81"),
    ]
    x = ex.features(model, tok, pairs)
    y = torch.tensor([1.0, 0.0, 1.0, 0.0])
    w = ex.fit(x, y, l2=1e-3)
    assert ex.auc(x @ w, y) == 1.0  # four points in 576 dimensions: separable
    ex.save_rm(smollm2_dir, tmp_path / "rm", w, scale=2.0)
    rm = LlamaForSequenceClassification.from_pretrained(tmp_path / "rm", dtype=torch.float32).eval()
    for (q, r), xi in zip(pairs, x):
        text = tok.apply_chat_template(
            [{"role": "user", "content": q}, {"role": "assistant", "content": r}],
            tokenize=False,
            add_generation_prompt=False,
        )
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            got = rm(input_ids=ids).logits[0, 0].item()
        assert got == pytest.approx(2.0 * float(xi @ w), abs=1e-4)
