"""CHAMP (champ-dataset): 270 competition problems with answers, a held-out eval set.

The package ships one JSON (`champ_dataset/dataset_files/v0.json`) and `champ_dataset.load("v0")`, which
returns problems whose `.text`/`.answer` already drop the `@@` math markers of the raw fields.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mcore_rl.data.records import LoadSummary, PromptRecord, PromptStyle, build_prompt, check_style
from mcore_rl.data.registry import register_dataset

logger = logging.getLogger(__name__)


@dataclass
class ChampConfig(PromptStyle):
    prompt_template: str = "{question}\nPut your final answer within \\boxed{}."
    version: str = "v0"
    categories: list[str] | None = None  # e.g. ["Number-Theory"]; None keeps all five


@register_dataset("champ", ChampConfig)
def load_champ(cfg: ChampConfig) -> tuple[list[PromptRecord], LoadSummary]:
    check_style(cfg, "data")
    import champ_dataset

    try:
        problems = champ_dataset.load(cfg.version).problems
    except FileNotFoundError as e:
        raise ValueError(f"data.version={cfg.version!r}: no such champ_dataset version (try 'v0')") from e
    summary = LoadSummary(source=f"champ/{cfg.version}")
    records = []
    for i, (pid, p) in enumerate(problems.items()):
        if cfg.categories is not None and p.category not in cfg.categories:
            continue
        summary.total_rows += 1
        if not isinstance(p.text, str) or not p.text.strip():
            summary.bad(summary.source, i, "empty_prompt:text")
            continue
        if not isinstance(p.answer, str) or not p.answer.strip():
            summary.bad(summary.source, i, "empty_answer:answer")
            continue
        meta = {"source": summary.source, "category": p.category}
        records.append(PromptRecord(pid, build_prompt(p.text, cfg), p.answer.strip(), meta))
        summary.loaded += 1
    if cfg.categories is not None and not records:
        raise ValueError(f"data.categories={cfg.categories} matched no champ problem")
    summary.log(logger)
    return records, summary
