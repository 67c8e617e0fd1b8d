"""The one table between a dtype's spellings: the config's short names (`fp32`, `bf16`, `fp16`: model.dtype,
`mcore-rl-convert --dtype`), torch/HF long names (`float32`, ...: rollout.dtype, config.json `torch_dtype`,
SGLang payloads) and torch dtypes. Importing it does not import torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

LONG: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # short -> long
SHORT: tuple[str, ...] = tuple(LONG)
SHORT_OR_LONG: tuple[str, ...] = (*LONG, *LONG.values())
# model.bf16_matmul / mcore-rl-eval --bf16-matmul: which kernels compute bf16 products on a CPU (compat/bf16_matmul.py)
BF16_MATMUL_MODES: tuple[str, ...] = ("auto", "fp32", "native")


def short_name(dtype: str | torch.dtype) -> str:
    """`fp32` for "fp32", "float32" or torch.float32; ValueError for anything else."""
    text = str(dtype).removeprefix("torch.")
    for short, long in LONG.items():
        if text in (short, long):
            return short
    raise ValueError(f"unsupported dtype {dtype!r}: expected one of {', '.join(SHORT_OR_LONG)}")


def long_name(dtype: str | torch.dtype) -> str:
    """`float32` for "fp32", "float32" or torch.float32."""
    return LONG[short_name(dtype)]


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    import torch

    return getattr(torch, long_name(dtype))
