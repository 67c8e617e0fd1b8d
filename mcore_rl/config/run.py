"""`run.*` and the top-level `seed`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RunConfig:
    dir: str = "${hydra:runtime.output_dir}"  # metrics.jsonl, tensorboard/, checkpoints/, plots, hf export
