"""Held-out sets for `mcore-rl-eval`: a short spec string -> prompt records (mcore_rl/data loaders) + a scorer.

Spec grammar: `BASE[:key=value,key=value...]`; values are parsed as YAML scalars/lists (`ops=[+,-]` works).
    arithmetic                    the trainer's default held-out a+b set (seed 1000 = train seed 0 + 1000)
    champ                         CHAMP competition problems (champ-dataset, offline)
    reasoning_gym/NAME            a reasoning-gym task, scored by reasoning-gym's own `score_answer`
    hf/HUB_ID                     a Hugging Face dataset id (`split=test,subset=main`)
    PATH                          a local .jsonl/.json/.parquet file, directory or glob
    PATH.yaml                     a data yaml, the same dict the trainer's `data=` group takes
Every option is a field of the data kind's config (mcore_rl/data) plus `scorer=` (see SCORERS).
Why specs instead of a yaml per set: an evaluation names several sets on one command line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mcore_rl.data import PromptRecord, build_dataset
from mcore_rl.data.hf import ANSWER_TRANSFORMS
from mcore_rl.evaluation.scorers import SCORERS, Scorer, build_scorer

_LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")
_BOXED_TEMPLATE = "{question}\nPut your final answer within \\boxed{}."


@dataclass
class EvalSet:
    name: str
    records: list[PromptRecord]
    scorer: Scorer
    spec: dict[str, Any]


def _auto_answer(answer: str) -> str:
    """GSM8K '... #### 72' -> '72'; a MATH-style solution with \\boxed{} -> its content; else unchanged."""
    if "####" in answer:
        return ANSWER_TRANSFORMS["gsm8k"](answer)
    if "\\boxed{" in answer or "\\fbox{" in answer:
        return ANSWER_TRANSFORMS["boxed"](answer)
    return answer


def _base_arithmetic(arg: str | None, n: int) -> dict[str, Any]:
    return {"kind": "arithmetic", "seed": 1000, "size": n or 1024}  # --num-prompts 0 ("all"): the data default


def _base_champ(arg: str | None, n: int) -> dict[str, Any]:
    return {"kind": "champ"}


def _base_reasoning_gym(arg: str | None, n: int) -> dict[str, Any]:
    if not arg:
        raise ValueError("reasoning_gym needs a task name: reasoning_gym/NAME (e.g. reasoning_gym/gcd)")
    return {"kind": "reasoning_gym", "name": arg, "size": n or 1024, "seed": 1000, "scorer": "reasoning_gym"}


def _base_hf(arg: str | None, n: int) -> dict[str, Any]:
    if not arg:
        raise ValueError("hf needs a dataset id: hf/HUB_ID (e.g. hf/openai/gsm8k:subset=main,split=test)")
    return {"kind": "hf", "path": arg, "split": "test", "prompt_template": _BOXED_TEMPLATE,
            "answer_transform": "auto"}


BASES: dict[str, Callable[[str | None, int], dict[str, Any]]] = {
    "arithmetic": _base_arithmetic,
    "champ": _base_champ,
    "reasoning_gym": _base_reasoning_gym,
    "rg": _base_reasoning_gym,
    "hf": _base_hf,
}


def _options(text: str, spec: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in filter(None, _split_top(text)):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {spec!r}: option {part!r} is not key=value")
        out[key.strip()] = yaml.safe_load(value) if value.strip() else None
    return out


def _split_top(text: str) -> list[str]:
    """Split on commas outside [...] so list values (ops=[+,-]) survive."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [*parts, cur]


def parse_spec(spec: str, num_prompts: int) -> dict[str, Any]:
    """Spec string -> data dict (+ `scorer`); no data is loaded yet."""
    base, _, opts = spec.partition(":")
    if Path(spec).suffix in (".yaml", ".yml") or Path(base).suffix in (".yaml", ".yml"):
        path = Path(base)
        if not path.is_file():
            raise ValueError(f"--set {spec!r}: no such data yaml {path}")
        loaded = yaml.safe_load(path.read_text())
        if not isinstance(loaded, dict):
            raise ValueError(f"--set {spec!r}: {path} is not a mapping")
        out = {k: v for k, v in loaded.items() if k != "sampler"}
    else:
        head, _, arg = base.partition("/")
        if head in BASES:
            out = BASES[head](arg or None, num_prompts)
        elif Path(base).exists() or base.endswith(_LOCAL_SUFFIXES) or any(c in base for c in "*?"):
            out = {"kind": "hf", "path": base, "prompt_template": _BOXED_TEMPLATE, "answer_transform": "auto"}
        else:
            raise ValueError(f"--set {spec!r}: unknown set; use one of {sorted(BASES)} (arithmetic, champ, "
                             "reasoning_gym/NAME, hf/HUB_ID), a local .jsonl/.json/.parquet path or a data .yaml")
    out.update(_options(opts, spec))
    return out


def set_name(spec: str) -> str:
    """A short metric-safe name for a spec: `reasoning_gym/gcd:size=8` -> `reasoning_gym_gcd`, a path -> its stem."""
    base = spec.partition(":")[0]
    head = base.partition("/")[0]
    if head not in BASES and (Path(base).suffix or "/" in base):
        base = Path(base).stem
    return "".join(c if c.isalnum() or c in "_-." else "_" for c in base).strip("_") or "set"


def load_set(spec: str, num_prompts: int, reward=None) -> EvalSet:
    """Parse, load through mcore_rl.data's registry, keep the first `num_prompts` records, attach the scorer
    (`reward`: see build_scorer)."""
    options = parse_spec(spec, num_prompts)
    scorer_name = options.pop("scorer", None) or "math_verify"
    if scorer_name not in SCORERS:
        raise ValueError(f"--set {spec!r}: scorer={scorer_name!r} unknown; registered: {sorted(SCORERS)}")
    auto = options.get("answer_transform") == "auto"
    if auto:
        options["answer_transform"] = "none"
    try:
        ds = build_dataset(options)
    except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
        raise ValueError(f"--set {spec!r}: {str(e).strip(chr(39))}") from None
    records = list(ds)[:num_prompts] if num_prompts > 0 else list(ds)
    if not records:
        raise ValueError(f"--set {spec!r}: no prompts loaded ({ds.summary.line()})")
    if auto:
        for r in records:
            r.answer = _auto_answer(r.answer)
    return EvalSet(ds.name, records, build_scorer(scorer_name, options, reward=reward), options)
