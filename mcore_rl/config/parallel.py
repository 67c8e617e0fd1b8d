"""`parallel.*`: model parallelism; data parallelism is what is left of the world size."""

from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.config.checks import positive


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    ep: int = 1                     # expert-parallel ranks (MoE models), carved out of data parallelism
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "ep"):
            positive(f"parallel.{key}", getattr(self, key))
