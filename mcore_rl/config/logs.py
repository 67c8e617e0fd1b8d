"""`logging.*`: where metrics go besides run.dir/metrics.jsonl (always written: eval and summaries read it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoggingConfig:
    tensorboard: bool = True        # run.dir/tensorboard event files
    wandb: bool = False             # needs `pip install wandb` and WANDB_* env
    wandb_project: str = "mcore-rl"
    progress: bool = True           # progress bar on rank 0
    plot: bool = True               # reward + phase-time curves as PNG (run.dir/curves.png) at the end
