"""The tiny model's task (tests/e2e/sevens.py): the offset that makes "7" likely, and data=sevens' questions.
Unit level, no CLI: the CLI tests that train on the task are the rest of tests/e2e."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.config.checks import ConfigError
from mcore_rl.data.generators import ArithmeticConfig, make_arithmetic
from mcore_rl.models.tiny_task import make_token_likely


@pytest.fixture(scope="module")
def random_tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from mcore_rl.models.smollm2 import materialize_smollm2

    tok = AutoTokenizer.from_pretrained(materialize_smollm2())
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(config), tok


def _p_next(model, tok, token: str) -> torch.Tensor:
    ids = tok("What is 3 + 4? Answer with just the number.", return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).logits[0].float().softmax(-1)[:, tok.convert_tokens_to_ids(token)]


def test_the_likely_token_becomes_likely_at_every_position(random_tiny):
    model, tok = random_tiny
    before = _p_next(model, tok, "7")
    make_token_likely(model, tok, "7", boost=0.75, seed=0)
    after = _p_next(model, tok, "7")
    print(f'p("7") per position: random {before.max():.2e} -> {after.min():.3f}..{after.max():.3f}')
    assert before.max() < 1e-4  # near-uniform over ~49k tokens (2e-5)
    # ~0.007 at every position, ~350x uniform: a 16-token response often holds a 7 and then few other digits,
    # so the reward (its last number) is 1 for about half the samples in the CLI runs
    assert after.min() > 100 * before.max()


def test_a_token_the_tokenizer_splits_or_an_untied_head_is_refused(random_tiny):
    model, tok = random_tiny
    with pytest.raises(ConfigError, match="model.tiny.likely_token='77' is not one token"):
        make_token_likely(model, tok, "77", boost=0.75)
    untied = type(model)(type(model.config)(**{**model.config.to_dict(), "tie_word_embeddings": False}))
    with pytest.raises(ConfigError, match="needs tie_word_embeddings"):
        make_token_likely(untied, tok, "7", boost=0.75)


def test_sevens_questions_all_answer_7():
    records, _ = make_arithmetic(ArithmeticConfig(size=64, max_operand=7, answer=7))
    metas = [r.metadata for r in records]
    assert all(r.answer == "7" for r in records) and all(m["a"] + m["b"] == 7 for m in metas)
    assert len({m["a"] for m in metas}) == 8  # a = 0..7: eight different questions
    with pytest.raises(ValueError, match=r"data.answer=7: needs ops=\['\+'\]"):
        make_arithmetic(ArithmeticConfig(ops=["+", "-"], max_operand=7, answer=7))
    with pytest.raises(ValueError, match="max_operand <= answer"):
        make_arithmetic(ArithmeticConfig(max_operand=20, answer=7))
