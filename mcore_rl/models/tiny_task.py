"""A likely token for the random tiny model, so that RL on it has a signal.

Why: a randomly initialised model samples near-uniformly from a 49k-token vocabulary, so it never answers a
question right, every group's rewards are equal, and every group is dropped as zero-variance: a run on it takes
no gradient step. Making one token likely (e.g. "7", with data=sevens whose answers are all 7) gives about half
the samples a reward of 1 while the model stays tiny and random everywhere else.

How: every embedding row gets the same offset c (|c| = 1, several times a random row's norm), so the final norm's
output is close to c's direction at every position. With a tied LM head that shifts every logit by the same amount
(no effect on sampling) except the likely token's row, which gets `boost` * c more.
"""

from __future__ import annotations

import torch

from mcore_rl.config.checks import ConfigError


def make_token_likely(model: torch.nn.Module, tokenizer, token: str, boost: float, seed: int = 0) -> None:
    """Shift the tied input embeddings in place so that `token` is likely (see the module docstring)."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    if (
        token_id is None
        or token_id == tokenizer.unk_token_id
        or tokenizer.convert_ids_to_tokens(token_id) != token
    ):
        raise ConfigError(f"model.tiny.likely_token={token!r} is not one token of the tokenizer")
    emb = model.get_input_embeddings().weight
    if model.get_output_embeddings().weight is not emb:
        raise ConfigError(
            "model.tiny.likely_token needs tie_word_embeddings (the LM head reads the offset rows)"
        )
    c = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(seed))
    c /= c.norm()
    with torch.no_grad():
        emb += c
        emb[token_id] += boost * c
