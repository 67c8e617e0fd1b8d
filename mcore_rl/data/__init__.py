"""Prompt data: HF/local datasets, generators (a+b, reasoning-gym), CHAMP eval, sampler, chat templating."""

from mcore_rl.data.chat import render_prompt, render_prompt_text
from mcore_rl.data.records import BadRow, LoadSummary, PromptRecord, PromptStyle
from mcore_rl.data.registry import DATASETS, PromptDataset, build_dataset, register_dataset
from mcore_rl.data.sampler import PromptSampler, build_sampler

__all__ = [
    "DATASETS",
    "BadRow",
    "LoadSummary",
    "PromptDataset",
    "PromptRecord",
    "PromptSampler",
    "PromptStyle",
    "build_dataset",
    "build_sampler",
    "register_dataset",
    "render_prompt",
    "render_prompt_text",
]
