"""`eval.*`: the held-out evaluation the trainer runs before the first update, every N updates and at the end."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mcore_rl.config.checks import ConfigError, positive


@dataclass
class EvalConfig:
    every: int = 10                 # evaluate every N updates (0 = only before the first and at the end)
    num_prompts: int = 32           # 0 turns evaluation off
    samples_per_prompt: int = 4     # k for mean@k / pass@k
    temperature: float = 0.7
    max_new_tokens: int = 48
    seed: int = 777
    data: Any = None                # held-out prompt set (a data yaml dict); null = the training kind, seed + 1000
    sets: list[Any] = field(default_factory=list)  # several held-out sets as `mcore-rl-eval --set` specs; the
    #                                 first is the headline metric (checked in trainer/prompts.py, which loads them)

    def __post_init__(self) -> None:
        positive("eval.every", self.every, allow_zero=True)
        positive("eval.num_prompts", self.num_prompts, allow_zero=True)
        positive("eval.samples_per_prompt", self.samples_per_prompt)
        positive("eval.max_new_tokens", self.max_new_tokens)
        positive("eval.temperature", self.temperature, allow_zero=True)  # 0 = greedy eval
        if self.data is not None and not (hasattr(self.data, "keys") and "kind" in self.data):
            raise ConfigError(f"eval.data must be a data config with a 'kind' (like hydra_conf/data/*.yaml), "
                              f"got {self.data!r}")
