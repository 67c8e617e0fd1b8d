"""What the reward-model (ScoreModel) tests share: a tiny random HF sequence classifier, token rows that exercise
HF's scored-token rule, and HF's own scores of a padded batch (the reference)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_rm(
    folder: Path, seed: int = 0, num_labels: int = 2, architecture: str = "llama", **overrides
) -> Path:
    """A random 4-layer `*ForSequenceClassification` (4 heads / 2 KV heads: TP=2 splits it; SmolLM2's 9 heads do
    not) with pad token 0 and `num_labels` columns, weights widened so scores are not all near zero."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    kw = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        num_labels=num_labels,
        pad_token_id=0,
    )
    if architecture.startswith("qwen3"):
        kw["head_dim"] = 16
    if architecture == "qwen3_moe":  # 4 experts, top-2
        kw.update(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    kw.update(overrides)
    config = AutoConfig.for_model(architecture, **kw)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.save_pretrained(folder)
    return folder


def make_tiny_chat_rm(folder: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A tiny one-label Llama RM with `tokenizer_dir`'s tokenizer and chat template (pad `<|endoftext|>`, as the
    test RM of tests/rewards/rm_fixture.py): what the rm reward renders with, at a size TP=2 can split."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.pad_token = "<|endoftext|>"
    make_tiny_rm(folder, seed, num_labels=1, vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    tok.save_pretrained(folder)
    return folder


def sample_rows(vocab: int, pad: int, seed: int = 0) -> list[list[int]]:
    """Rows of different lengths: plain ones, one with a pad token inside, one ending in pad tokens (HF scores the
    token before them), one of pad tokens only (HF scores position 0)."""
    g = torch.Generator().manual_seed(seed)
    rows = [
        [t if t != pad else pad + 1 for t in torch.randint(0, vocab, (n,), generator=g).tolist()]
        for n in (5, 23, 11, 40, 2, 17)
    ]
    rows[1][7] = pad
    rows[2][-2:] = [pad, pad]
    rows[4] = [pad, pad]
    return rows


def hf_padded_scores(folder: Path, rows: list[list[int]], pad: int) -> torch.Tensor:
    """HF's `model(input_ids, attention_mask).logits` [rows, num_labels] on one right-padded fp32 batch."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.float()
