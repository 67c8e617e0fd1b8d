"""Per-sample bookkeeping of the local engine: a row's state, its admission checks, stop rules and final Sample.

Kept apart from the engine's threading (engine.py) and tensor side (decode_batch.py): everything here is plain
Python over one row, so the rules for when a sample stops and what it returns can be read in one place.
"""

from __future__ import annotations

import random
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from mcore_rl.rollout.local.token_sampler import RowParams, sample_next, sample_next_top
from mcore_rl.rollout.protocol import GenerationRequest, Sample, sample_seed

# A request whose metadata holds TOP_LOGPROBS_NUM = k > 0 gets, per output token, the k largest log-probs of the
# distribution it was drawn from: Sample.metadata[OUTPUT_TOP_LOGPROBS] = [[(logprob, token_id), ...] per token].
# Why metadata and not SamplingParams: only the OpenAI routes of mcore-rl-serve ask for it (SGLang's
# top_logprobs_num), and the trainer's protocol stays as it is.
TOP_LOGPROBS_NUM = "top_logprobs_num"
OUTPUT_TOP_LOGPROBS = "output_top_logprobs"


@dataclass
class Row:
    """One sample being generated; owned by the stepping thread (stepping.py) once admitted."""

    req: GenerationRequest
    index: int
    future: Future
    generator: torch.Generator
    seed: int  # the generator's seed: an interrupted row restarts from its prompt with the same draws
    stop_ids: frozenset[int]
    max_len: int  # model context limit
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top: list[list[tuple[float, int]]] = field(default_factory=list)  # per token, with TOP_LOGPROBS_NUM
    abort_requested: bool = False
    finish: str | None = None
    matched: int | str | None = None

    def restart(self) -> None:
        """Back to the prompt with the same draws (interrupt mode: a weight update discards in-flight tokens)."""
        self.out, self.logprobs, self.versions, self.top = [], [], [], []
        self.generator = torch.Generator().manual_seed(self.seed)


def eos_ids(model) -> frozenset[int]:
    """Every EOS id the model's config and generation config name (either may hold an int or a list)."""
    ids: set[int] = set()
    for src in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(src, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return frozenset(ids)


def make_row(
    req: GenerationRequest,
    j: int,
    *,
    eos: frozenset[int],
    max_len: int,
    vocab: int,
    has_tokenizer: bool,
    seed_rng: random.Random,
    model_path: str,
) -> Row:
    """Validate one sample of `req` against the model (one-line errors naming the request) and make its row."""
    sp = req.sampling
    if sp.stop and not has_tokenizer:
        raise ValueError(f"request {req.rid!r}: stop strings need a tokenizer, {model_path} has none")
    if len(req.prompt_ids) >= max_len:
        raise ValueError(f"request {req.rid!r}: prompt of {len(req.prompt_ids)} tokens >= context {max_len}")
    if max(req.prompt_ids) >= vocab or min(req.prompt_ids) < 0:
        raise ValueError(f"request {req.rid!r}: prompt token id out of range [0, {vocab})")
    seed = sample_seed(sp.seed, j)
    seed = seed if seed is not None else seed_rng.getrandbits(63)
    gen = torch.Generator().manual_seed(seed)
    stop_ids = frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else eos)
    return Row(
        req=req, index=j, future=Future(), generator=gen, seed=seed, stop_ids=stop_ids, max_len=max_len
    )


def finish_check(row: Row, token: int, tokenizer) -> None:
    """Set row.finish after `token` was appended: a stop id, a stop string in the decoded tail, or a length limit."""
    sp = row.req.sampling
    if token in row.stop_ids:
        row.finish, row.matched = "stop", token
    elif sp.stop:
        tail = tokenizer.decode(row.out[-4 * max(map(len, sp.stop)) - 4 :])
        hit = next((s for s in sp.stop if s in tail), None)
        if hit is not None:
            row.finish, row.matched = "stop", hit
    if row.finish is None and (
        len(row.out) >= sp.max_new_tokens or len(row.req.prompt_ids) + len(row.out) >= row.max_len
    ):
        row.finish = "length"


def sample_rows(rows: list[Row], logits: torch.Tensor, version: int, tokenizer, index_free: bool) -> torch.Tensor:
    """Draw each row's next token from its logits row with its own sampling settings and generator; append
    token, log-prob and weight version and apply the stop rules. Returns the tokens [B]."""
    sps = [r.req.sampling for r in rows]
    params = RowParams.build([s.temperature for s in sps], [s.top_p for s in sps], [s.top_k for s in sps],
                             [r.generator for r in rows])  # fmt: skip
    wants = [int(r.req.metadata.get(TOP_LOGPROBS_NUM) or 0) for r in rows]
    if max(wants) > 0:
        tokens, logprobs, top_v, top_i = sample_next_top(logits, params, max(wants), index_free=index_free)
        for row, k, vals, ids in zip(rows, wants, top_v.tolist(), top_i.tolist()):
            if k > 0:
                row.top.append(list(zip(vals[:k], ids[:k])))
    else:
        tokens, logprobs = sample_next(logits, params, index_free=index_free)
    for row, tok, lp in zip(rows, tokens.tolist(), logprobs.tolist()):
        row.out.append(tok)
        row.logprobs.append(lp)
        row.versions.append(version)
        finish_check(row, tok, tokenizer)
    return tokens


def tokens_left(row: Row) -> int:
    """Decode steps this row may still take: what the KV cache reserves room for when it is admitted."""
    room = row.max_len - len(row.req.prompt_ids)
    return max(min(row.req.sampling.max_new_tokens, room) - len(row.out), 1)


def to_sample(row: Row, tokenizer, return_text: bool) -> Sample:
    """The protocol's Sample for a finished (or aborted) row; text is cut before a matched stop string."""
    text = None
    if return_text and tokenizer is not None:
        text = tokenizer.decode(row.out, skip_special_tokens=True)
        if isinstance(row.matched, str) and row.matched in text:
            text = text[: text.index(row.matched)]
    return Sample(
        rid=row.req.rid,
        prompt_ids=list(row.req.prompt_ids),
        output_ids=row.out,
        output_logprobs=row.logprobs,
        weight_versions=row.versions,
        finish_reason=row.finish or "abort",
        text=text,
        matched_stop=row.matched,
        sample_index=row.index,
        metadata={**row.req.metadata, **({OUTPUT_TOP_LOGPROBS: row.top} if row.top else {})},
    )
