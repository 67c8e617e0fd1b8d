"""`hf` datasets: a Hugging Face hub id or local jsonl/json/parquet files, with a field mapping.

Local paths are detected by existence/extension (see files.resolve_local); anything else goes to
`datasets.load_dataset(id, name=subset, split=split)`. Every row is validated: malformed rows are counted with
their file and row index in a LoadSummary and skipped; a field missing from *every* row is a config error.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from mcore_rl.data.files import BadJson, read_rows, resolve_local
from mcore_rl.data.records import LoadSummary, PromptRecord, PromptStyle, build_prompt, check_style
from mcore_rl.data.registry import register_dataset
from mcore_rl.rewards.extract import last_boxed

logger = logging.getLogger(__name__)


def _gsm8k(answer: str) -> str:
    """GSM8K solutions end with '#### 72': keep the number."""
    return answer.rsplit("####", 1)[-1].strip().replace(",", "") if "####" in answer else answer


ANSWER_TRANSFORMS: dict[str, Callable[[str], str]] = {
    "none": lambda a: a,
    "gsm8k": _gsm8k,
    "boxed": lambda a: last_boxed(a) or a,  # MATH-style full solutions: keep the \boxed{} content
}


@dataclass
class HFDataConfig(PromptStyle):
    path: str | list[str] = ""  # hub id, file, directory, glob, or a list of files
    split: str = "train"  # hub only
    subset: str | None = None  # hub config name
    revision: str | None = None  # hub only
    prompt_field: str = "question"  # dotted paths reach nested fields ("extra_info.question")
    answer_field: str = "answer"
    id_field: str | None = None  # default id: "<file or hub id>:<row>"
    metadata_fields: list[str] = field(default_factory=list)
    answer_transform: str = "none"  # none | gsm8k | boxed
    json_field: str | None = None  # .json files shaped {"<json_field>": [rows]}
    limit: int | None = None  # keep the first N valid records


def get_field(row: dict, dotted: str) -> Any:
    cur: Any = row
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return _MISSING
        cur = cur[part]
    return cur


_MISSING = object()


def _messages_ok(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    )


class RowConverter:
    """Turns raw rows into PromptRecords, recording why a row was rejected."""

    def __init__(self, cfg: HFDataConfig, summary: LoadSummary):
        self.cfg, self.summary = cfg, summary
        self.missing: Counter = Counter()
        self.columns: set[str] = set()
        self.object_rows = 0
        self.ids: set[str] = set()
        self.transform = ANSWER_TRANSFORMS[cfg.answer_transform]

    def __call__(self, row: Any, file: str, idx: int) -> PromptRecord | None:
        cfg, bad = self.cfg, self.summary.bad
        self.summary.total_rows += 1
        if isinstance(row, BadJson):
            return bad(file, idx, str(row))
        if not isinstance(row, dict):
            return bad(file, idx, f"not_an_object:{type(row).__name__}")
        self.object_rows += 1
        if len(self.columns) < 200:
            self.columns.update(row)
        values = {}
        for name in [cfg.prompt_field, cfg.answer_field] + ([cfg.id_field] if cfg.id_field else []):
            values[name] = get_field(row, name)
            if values[name] is _MISSING or values[name] is None:
                self.missing[name] += 1
                return bad(file, idx, f"missing_field:{name}")
        question, answer = values[cfg.prompt_field], values[cfg.answer_field]
        if isinstance(question, str):
            if not question.strip():
                return bad(file, idx, f"empty_prompt:{cfg.prompt_field}")
            prompt = build_prompt(question, cfg)
        elif _messages_ok(question) and cfg.prompt_format == "chat":
            prompt = [dict(m) for m in question]
            if cfg.system_prompt is not None and prompt[0]["role"] != "system":
                prompt.insert(0, {"role": "system", "content": cfg.system_prompt})
        else:
            return bad(file, idx, f"non_string_prompt:{cfg.prompt_field} is {type(question).__name__}")
        if isinstance(answer, int | float) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str):
            return bad(file, idx, f"non_string_answer:{cfg.answer_field} is {type(answer).__name__}")
        answer = self.transform(answer).strip()
        if not answer:
            return bad(file, idx, f"empty_answer:{cfg.answer_field}")
        pid = str(values[cfg.id_field]) if cfg.id_field else f"{file}:{idx}"
        if pid in self.ids:
            return bad(file, idx, f"duplicate_id:{pid}")
        self.ids.add(pid)
        meta = {"source": file, "row": idx}
        for key in cfg.metadata_fields:
            value = get_field(row, key)
            meta[key] = None if value is _MISSING else value
        self.summary.loaded += 1
        return PromptRecord(pid, prompt, answer, meta)

    def check_fields(self) -> None:
        """A field absent from every row is a mapping mistake, not bad data: fail loudly."""
        fields = [("prompt_field", self.cfg.prompt_field), ("answer_field", self.cfg.answer_field)]
        if self.cfg.id_field:
            fields.append(("id_field", self.cfg.id_field))
        for option, name in fields:
            if self.object_rows and self.missing[name] == self.object_rows:
                raise ValueError(
                    f"data.{option}={name!r} is missing from every row of {self.summary.source}; "
                    f"available columns: {sorted(self.columns)}"
                )


def _hub_rows(cfg: HFDataConfig) -> Iterable[tuple[str, int, Any]]:
    import datasets

    try:
        ds = datasets.load_dataset(cfg.path, name=cfg.subset, split=cfg.split, revision=cfg.revision)
    except Exception as e:
        raise ValueError(
            f"data.path={cfg.path!r} is not a local file, and loading it from the Hugging Face hub "
            f"(split={cfg.split!r}, subset={cfg.subset!r}) failed: {type(e).__name__}: {e}"
        ) from e
    tag = f"{cfg.path}/{cfg.split}"
    for i, row in enumerate(ds):
        yield tag, i, row


@register_dataset("hf", HFDataConfig)
def load_hf(cfg: HFDataConfig) -> tuple[list[PromptRecord], LoadSummary]:
    check_style(cfg, "data")
    if cfg.answer_transform not in ANSWER_TRANSFORMS:
        raise ValueError(f"data.answer_transform={cfg.answer_transform!r}; choose from {sorted(ANSWER_TRANSFORMS)}")
    files = resolve_local(cfg.path)
    if files is None:
        summary, rows = LoadSummary(source=f"hub:{cfg.path}"), _hub_rows(cfg)
    else:
        names = [f.name for f in files]
        # Short names in ids/reports when unambiguous; full paths when two files share a name.
        labels = names if len(set(names)) == len(names) else [str(f) for f in files]
        summary = LoadSummary(source=", ".join(labels) if len(labels) <= 3 else f"{len(labels)} files")
        rows = ((lab, i, row) for f, lab in zip(files, labels) for i, row in read_rows(f, cfg.json_field))
    convert = RowConverter(cfg, summary)
    records: list[PromptRecord] = []
    for file, idx, row in rows:
        rec = convert(row, file, idx)
        if rec is not None:
            records.append(rec)
            if cfg.limit is not None and len(records) >= cfg.limit:
                break
    convert.check_fields()
    summary.log(logger)
    if not records:
        raise ValueError(f"no usable rows: {summary.line()}")
    return records, summary
