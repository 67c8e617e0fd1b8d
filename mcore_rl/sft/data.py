"""SFT rows from local jsonl / json / parquet files -> tokenised examples, with bad rows counted and named.

Why count instead of fail: a demonstration file assembled from many sources always has a few rows a template
cannot render or that do not fit `sft.max_length`; one bad row must not stop a run, and a skipped row must not go
unnoticed. Each kind is one log line with its count, the file and an example row number (`DataReport.lines`).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mcore_rl.config import ConfigError
from mcore_rl.data.files import BadJson, read_rows, resolve_local
from mcore_rl.sft.template import BadRow, Example, TemplateMasker, conversation_of

log = logging.getLogger("mcore_rl")


@dataclass
class DataReport:
    """Rows read, examples kept, and per bad kind: (count, first file, first row number)."""

    rows: int = 0
    kept: int = 0
    bad: dict[str, list[Any]] = field(default_factory=dict)

    def add(self, kind: str, path: Path, row: int) -> None:
        entry = self.bad.setdefault(kind, [0, str(path), row])
        entry[0] += 1

    def lines(self, what: str) -> list[str]:
        return [
            f"{what}: skipped {n} row(s) of kind {kind} (e.g. {path} row {row})"
            for kind, (n, path, row) in sorted(self.bad.items())
        ]

    def merged(self, other: DataReport) -> DataReport:
        out = DataReport(
            self.rows + other.rows, self.kept + other.kept, {k: list(v) for k, v in self.bad.items()}
        )
        for kind, (n, path, row) in other.bad.items():
            out.bad.setdefault(kind, [0, path, row])[0] += n
        return out


def _files(path: str | list[str], key: str) -> list[Path]:
    try:
        files = resolve_local(path)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"{key}: {str(e).removeprefix('data.path ')}") from None
    if files is None:
        raise ConfigError(f"{key}={path!r}: no such file (SFT reads local .jsonl / .json / .parquet files)")
    return files


def load_examples(
    path: str | list[str], key: str, masker: TemplateMasker, max_length: int
) -> tuple[list[Example], DataReport]:
    """Every row of the files `path` names, tokenised; bad rows counted by kind."""
    report, out = DataReport(), []
    for f in _files(path, key):
        for i, row in read_rows(f):
            report.rows += 1
            if isinstance(row, BadJson):
                report.add("bad_json", f, i)
                continue
            try:
                out.append(masker.example(conversation_of(row), max_length))
            except BadRow as e:
                report.add(e.kind, f, i)
    report.kept = len(out)
    return out, report


def split_heldout(
    examples: Sequence[Example], fraction: float, seed: int
) -> tuple[list[Example], list[Example]]:
    """A seeded held-out split: the same rows every run (and every rank) with the same seed."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n = int(round(fraction * len(examples)))
    if fraction > 0 and len(examples) > 1:
        n = min(max(n, 1), len(examples) - 1)
    held = sorted(order[:n])
    train = sorted(order[n:])
    return [examples[i] for i in train], [examples[i] for i in held]


def load_sft_data(
    data: Any, masker: TemplateMasker, max_length: int, seed: int
) -> tuple[list[Example], list[Example], list[str]]:
    """(train, held-out, report lines) from `sft.data`: a held-out file, or a seeded fraction of the train rows."""
    if not data.path:
        raise ConfigError("sft.data.path is required: a .jsonl / .json / .parquet file of conversations")
    train, report = load_examples(data.path, "sft.data.path", masker, max_length)
    lines = report.lines("sft.data.path")
    if data.heldout_path:
        held, held_report = load_examples(data.heldout_path, "sft.data.heldout_path", masker, max_length)
        lines += held_report.lines("sft.data.heldout_path")
    else:
        train, held = split_heldout(train, data.heldout_fraction, seed)
    if not train:
        raise ConfigError(
            f"sft.data.path={data.path!r}: no usable row ({report.rows} read; "
            + ("; ".join(lines) or "empty")
            + ")"
        )
    lines.append(
        f"sft data: {len(train)} train / {len(held)} held-out conversations, "
        f"{sum(e.scored for e in train)} assistant tokens to train on"
    )
    return train, held, lines
