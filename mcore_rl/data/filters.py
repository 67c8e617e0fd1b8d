"""Load-time filters that need the tokenizer: rows the engine could never serve are counted and dropped once.

Why at load and not at sampling: the sampler is deterministic, so a prompt that makes the engine raise would come
back at the same position after every resume. Dropping it from the dataset (with its file/row in the summary) makes
the order a pure function of the filtered dataset, identical on every (re)start.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from mcore_rl.data.records import PromptRecord
from mcore_rl.data.registry import PromptDataset

_FILE_ROW = re.compile(r"^(?P<file>.+):(?P<row>\d+)$")


def _where(rec: PromptRecord, index: int, source: str) -> tuple[str, int]:
    """File and row of a record: from a "<file>:<row>" id when it has one, else the dataset and its index."""
    m = _FILE_ROW.match(rec.prompt_id)
    return (m["file"], int(m["row"])) if m else (source, index)


def drop_overlong(dataset: PromptDataset, prompt_tokens: Callable[[PromptRecord], int], max_new_tokens: int,
                  context: int) -> PromptDataset:
    """Keep rows whose rendered prompt plus `max_new_tokens` fits `context`; the rest are counted in the summary
    as `prompt_too_long` with file/row. Raises when nothing is left (a config problem, not a data one)."""
    limit = context - max_new_tokens
    kept: list[PromptRecord] = []
    summary = dataset.summary
    for i, rec in enumerate(dataset):
        n = prompt_tokens(rec)
        if n > limit:
            file, row = _where(rec, i, summary.source)
            summary.bad(file, row, f"prompt_too_long:{n} prompt tokens + {max_new_tokens} new > context {context}")
        else:
            kept.append(rec)
    if not kept:
        raise ValueError(f"data: every prompt is longer than the context ({context}) minus max_new_tokens "
                         f"({max_new_tokens}); {summary.line()}")
    if len(kept) == len(dataset):
        return dataset
    summary.loaded = len(kept)
    return PromptDataset(dataset.name, kept, summary)
