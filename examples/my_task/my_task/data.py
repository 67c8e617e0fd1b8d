"""`data.kind=apples`: seeded word problems ("Mia has 7 apples and buys 5 more...") with integer answers.

A data kind is a dataclass of options (every yaml key is checked against it, one line per bad key) and a loader
that returns PromptRecords plus a load summary. Registering it under a name is all mcore-rl needs."""

from __future__ import annotations

import random
from dataclasses import dataclass

from mcore_rl.data.records import LoadSummary, PromptRecord, PromptStyle, build_prompt
from mcore_rl.data.registry import register_dataset

NAMES = ("Mia", "Leo", "Ava", "Sam", "Noah", "Zoe")
STORIES = (  # (template, answer): the two operands a <= max_operand, b <= a
    ("{name} has {a} apples and buys {b} more. How many apples does {name} have now?", lambda a, b: a + b),
    ("{name} has {a} apples and eats {b} of them. How many apples are left?", lambda a, b: a - b),
)


@dataclass
class ApplesConfig(PromptStyle):
    size: int = 1024
    seed: int = 0
    max_operand: int = 20
    suffix: str = " Answer with just the number."


@register_dataset("apples", ApplesConfig)
def load_apples(cfg: ApplesConfig) -> tuple[list[PromptRecord], LoadSummary]:
    if cfg.size < 1 or cfg.max_operand < 1:
        raise ValueError(f"data: need size >= 1 and max_operand >= 1, got size={cfg.size}, "
                         f"max_operand={cfg.max_operand}")
    rng = random.Random(f"apples:{cfg.seed}")
    records = []
    for i in range(cfg.size):
        a = rng.randint(1, cfg.max_operand)
        b = rng.randint(0, a)
        template, answer = STORIES[rng.randrange(len(STORIES))]
        question = template.format(name=rng.choice(NAMES), a=a, b=b) + cfg.suffix
        records.append(PromptRecord(f"apples-s{cfg.seed}-{i}", build_prompt(question, cfg), str(answer(a, b)),
                                    {"a": a, "b": b}))
    return records, LoadSummary(source=f"apples(seed={cfg.seed})", total_rows=cfg.size, loaded=cfg.size)
