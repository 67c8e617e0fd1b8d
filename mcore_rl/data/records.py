"""Prompt records, prompt styling and the load summary shared by every dataset kind.

Why one record type: rollout, rewards and the sampler see the same four fields whatever the source
(hub, local files, generators), so a new source only has to produce `PromptRecord`s.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from mcore_rl.utils import config_from_dict  # noqa: F401  (re-exported)

Message = dict[str, str]
Prompt = str | list[Message]


@dataclass
class PromptRecord:
    """One prompt. `prompt` is chat messages (role/content) or plain text; `answer` is the gold string."""

    prompt_id: str
    prompt: Prompt
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        """Mapping-style access (`record["prompt"]`) for code that treats records as dicts."""
        if key not in ("prompt_id", "prompt", "answer", "metadata"):
            raise KeyError(key)
        return getattr(self, key)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class PromptStyle:
    """How a raw question becomes a prompt; shared by all dataset kinds."""

    prompt_template: str = "{question}"  # `{question}` is replaced verbatim (LaTeX braces are safe)
    system_prompt: str | None = None  # None keeps the chat template's own default system message
    prompt_format: str = "chat"  # chat: list of messages | text: plain string, no chat template


def check_style(style: PromptStyle, where: str) -> None:
    if "{question}" not in style.prompt_template:
        raise ValueError(f"{where}.prompt_template must contain '{{question}}'; got {style.prompt_template!r}")
    if style.prompt_format not in ("chat", "text"):
        raise ValueError(f"{where}.prompt_format must be 'chat' or 'text'; got {style.prompt_format!r}")


def build_prompt(question: str, style: PromptStyle) -> Prompt:
    text = style.prompt_template.replace("{question}", question)
    if style.prompt_format == "text":
        return text if style.system_prompt is None else f"{style.system_prompt}\n\n{text}"
    messages: list[Message] = []
    if style.system_prompt is not None:
        messages.append({"role": "system", "content": style.system_prompt})
    messages.append({"role": "user", "content": text})
    return messages


@dataclass
class BadRow:
    file: str
    row: int  # 0-based; for jsonl files it is the line number minus one
    reason: str

    def __str__(self) -> str:
        return f"{self.file} row {self.row}: {self.reason}"


@dataclass
class LoadSummary:
    """What was loaded and what was skipped, so malformed rows are counted and locatable, never lost."""

    source: str
    total_rows: int = 0
    loaded: int = 0
    skipped: Counter = field(default_factory=Counter)
    bad_rows: list[BadRow] = field(default_factory=list)
    max_reported: int = 1000  # keep at most this many BadRow entries (counts stay exact)

    def bad(self, file: str, row: int, reason: str) -> None:
        self.skipped[reason.split(":")[0]] += 1
        if len(self.bad_rows) < self.max_reported:
            self.bad_rows.append(BadRow(file, row, reason))

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def line(self, show: int = 5) -> str:
        text = f"data {self.source}: loaded {self.loaded}/{self.total_rows} rows"
        if not self.num_skipped:
            return text
        counts = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items()))
        first = "; ".join(str(b) for b in self.bad_rows[:show])
        more = "" if self.num_skipped <= show else f"; ... ({self.num_skipped - show} more)"
        return f"{text}; skipped {self.num_skipped} ({counts}): {first}{more}"

    def log(self, logger: logging.Logger) -> None:
        logger.log(logging.WARNING if self.num_skipped else logging.INFO, "%s", self.line())


