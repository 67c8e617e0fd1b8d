"""Offline procedural prompts: a seeded a+b generator and reasoning-gym tasks.

Why a built-in a+b task: SmolLM2-135M-Instruct answers "What is a + b? Answer with just the number."
(a, b <= 20) right ~28% of the time, the regime where RL visibly raises reward within minutes on CPU.
"""

from __future__ import annotations

import logging
import operator
import random
from dataclasses import dataclass, field
from typing import Any

from mcore_rl.data.records import LoadSummary, PromptRecord, PromptStyle, build_prompt, check_style
from mcore_rl.data.registry import register_dataset

logger = logging.getLogger(__name__)

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@dataclass
class ArithmeticConfig(PromptStyle):
    size: int = 1024
    seed: int = 0
    min_operand: int = 0
    max_operand: int = 20
    ops: list[str] = field(default_factory=lambda: ["+"])
    question: str = "What is {a} {op} {b}? Answer with just the number."
    # set: b = answer - a (ops must be ["+"]), so every question has this answer: data=sevens, the task of
    # `model=tiny_sevens`, whose random model makes "7" likely, so rewards vary within a group and updates train
    answer: int | None = None


@register_dataset("arithmetic", ArithmeticConfig)
def make_arithmetic(cfg: ArithmeticConfig) -> tuple[list[PromptRecord], LoadSummary]:
    check_style(cfg, "data")
    if cfg.size < 1 or cfg.min_operand > cfg.max_operand:
        raise ValueError(f"data: need size >= 1 and min_operand <= max_operand; got {cfg}")
    bad_ops = [op for op in cfg.ops if op not in _OPS]
    if not cfg.ops or bad_ops:
        raise ValueError(f"data.ops={list(cfg.ops)}: each must be one of {sorted(_OPS)}")
    if cfg.answer is not None and (list(cfg.ops) != ["+"] or not 0 <= cfg.min_operand <= cfg.max_operand <= cfg.answer):
        raise ValueError(f"data.answer={cfg.answer}: needs ops=['+'] and 0 <= min_operand <= max_operand <= answer")
    rng = random.Random(f"arithmetic:{cfg.seed}")
    records = []
    for i in range(cfg.size):
        a = rng.randint(cfg.min_operand, cfg.max_operand)
        b = rng.randint(cfg.min_operand, cfg.max_operand) if cfg.answer is None else cfg.answer - a
        op = cfg.ops[rng.randrange(len(cfg.ops))]
        question = cfg.question.format(a=a, op=op, b=b)
        meta = {"source": "arithmetic", "a": a, "b": b, "op": op}
        records.append(PromptRecord(f"arith-s{cfg.seed}-{i}", build_prompt(question, cfg), str(_OPS[op](a, b)), meta))
    summary = LoadSummary(source=f"arithmetic(seed={cfg.seed})", total_rows=cfg.size, loaded=cfg.size)
    return records, summary


@dataclass
class ReasoningGymConfig(PromptStyle):
    name: str = "basic_arithmetic"
    size: int = 1024
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)  # extra create_dataset kwargs (difficulty knobs)
    # {seed, size}: drop questions that also occur in that split (same task and options), e.g. the training split
    # excluding the held-out one. Seeds alone do not separate splits: reasoning-gym seeds item i with seed + i (seed
    # 1000 repeats items 1000.. of a larger seed-0 split) and short problems recur by chance. The split named here
    # never excludes itself: the trainer derives its held-out spec from the training one (seed + 1000, same keys),
    # so one yaml with exclude.seed = seed + 1000 gives a training split disjoint from the first `size` held-out
    # items (tests/data/test_exp_tasks.py).
    exclude: dict[str, int] | None = None


@register_dataset("reasoning_gym", ReasoningGymConfig)
def make_reasoning_gym(cfg: ReasoningGymConfig) -> tuple[list[PromptRecord], LoadSummary]:
    check_style(cfg, "data")
    import reasoning_gym

    try:
        ds = reasoning_gym.create_dataset(cfg.name, size=cfg.size, seed=cfg.seed, **cfg.options)
    except Exception as e:
        raise ValueError(f"data.name={cfg.name!r}: reasoning_gym.create_dataset failed: {type(e).__name__}: {e}") from e
    source = f"reasoning_gym/{cfg.name}"
    summary = LoadSummary(source=f"{source}(seed={cfg.seed})")
    excluded = _excluded_questions(cfg)
    records = []
    for i in range(len(ds)):
        entry = ds[i]
        summary.total_rows += 1
        question, answer = entry.get("question"), entry.get("answer")
        if not isinstance(question, str) or not question.strip():
            summary.bad(source, i, "empty_prompt:question")
            continue
        if answer is None or not str(answer).strip():
            summary.bad(source, i, "empty_answer:answer")
            continue
        if question in excluded:
            summary.bad(source, i, f"in_excluded_split:seed={cfg.exclude['seed']}")
            continue
        meta = {"source": source, **dict(entry.get("metadata") or {})}
        records.append(PromptRecord(f"rg-{cfg.name}-s{cfg.seed}-{i}", build_prompt(question, cfg), str(answer).strip(), meta))
        summary.loaded += 1
    summary.log(logger)
    return records, summary


def _excluded_questions(cfg: ReasoningGymConfig) -> set[str]:
    """The questions of the `exclude` split (same task and options), compared verbatim."""
    if cfg.exclude is None:
        return set()
    ex = dict(cfg.exclude)
    if set(ex) != {"seed", "size"} or not all(isinstance(v, int) for v in ex.values()) or ex["size"] < 1:
        raise ValueError(f"data.exclude: expected {{seed: int, size: int >= 1}}, got {ex}")
    if ex["seed"] == cfg.seed:
        return set()
    import reasoning_gym

    other = reasoning_gym.create_dataset(cfg.name, size=ex["size"], seed=ex["seed"], **cfg.options)
    return {other[i].get("question") for i in range(len(other))}
