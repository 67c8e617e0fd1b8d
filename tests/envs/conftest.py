"""Env fixtures: tiny random models behind two real chat templates.

- `smol_dir`: a tiny random Llama with the real SmolLM2-135M-Instruct tokenizer and chat template (ChatML).
- `qwen_dir`: a tiny random Qwen2 with a Qwen-style tokenizer: a byte-level BPE (SmolLM2's; no Qwen tokenizer
  ships offline) plus Qwen2.5's added tool tokens and a Qwen2.5-style template (qwen_template.jinja).
Random weights keep every engine test fast; what is under test is the token bookkeeping, not the replies.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import save_random_hf

HERE = Path(__file__).parent
QWEN_TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def _tokenizer(src: Path, extra_tokens: list[str] | None = None, template: str | None = None):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    if extra_tokens:
        tok.add_tokens(extra_tokens)
    if template is not None:
        tok.chat_template = template
    return tok


@pytest.fixture(scope="session")
def smol_dir(smollm2_dir, tmp_path_factory) -> Path:
    from transformers import LlamaConfig

    tok = _tokenizer(smollm2_dir)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=len(tok),
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=eot,
        bos_token_id=1,
        pad_token_id=eot,
    )
    folder = save_random_hf(tmp_path_factory.mktemp("env_smol"), cfg, seed=0)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def qwen_dir(smollm2_dir, tmp_path_factory) -> Path:
    from transformers import Qwen2Config

    tok = _tokenizer(smollm2_dir, QWEN_TOOL_TOKENS, (HERE / "qwen_template.jinja").read_text())
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=len(tok),
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=eot,
        pad_token_id=eot,
    )
    folder = save_random_hf(tmp_path_factory.mktemp("env_qwen"), cfg, seed=1)
    tok.save_pretrained(folder)
    return folder
