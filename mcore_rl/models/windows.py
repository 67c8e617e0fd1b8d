"""Per-layer sliding attention windows of the Qwen2 / Qwen3 families (`use_sliding_window`, `max_window_layers`,
`layer_types`), read into `ModelArgs.sliding_window` + `ModelArgs.window_layers`.

transformers' rule (Qwen2Config / Qwen3Config): with `use_sliding_window=true`, layer i attends within the last
`sliding_window` tokens iff `layer_types[i] == "sliding_attention"`; a config without `layer_types` gets
`sliding_attention` for i >= `max_window_layers` (the first `max_window_layers` layers stay full). With
`use_sliding_window=false` transformers sets `sliding_window` to None, so no layer has a window whatever
`layer_types` says; we refuse that contradiction rather than guess which of the two the author meant.

Megatron side: `window_size=(w - 1, 0)` with `window_attn_skip_freq` a per-layer 0/1 list (1 = windowed), which
Transformer Engine's attention and our SDPA attention (models/sdpa_attention.py) both read per layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mcore_rl.models.fields import Field, mapped

_TYPES = ("full_attention", "sliding_attention")


def _window_value(value: Any, hf: Mapping[str, Any]) -> str | None:
    if not hf.get("use_sliding_window") or value is None:
        return None
    return None if isinstance(value, int) and value >= 1 else "a window must be a positive number of tokens"


def _layer_types(value: Any, hf: Mapping[str, Any]) -> str | None:
    if value is None:
        return None
    n = hf.get("num_hidden_layers")
    bad = sorted({t for t in value if t not in _TYPES})
    if bad:
        return f"layer types {bad} are not implemented (full_attention, sliding_attention)"
    if len(value) != n:
        return f"{len(value)} layer types for a {n}-layer model"
    if "sliding_attention" in value and not hf.get("use_sliding_window"):
        return "lists sliding_attention layers but use_sliding_window is false (transformers then drops the window)"
    return None


def _max_window_layers(value: Any, hf: Mapping[str, Any]) -> str | None:
    return None if isinstance(value, int) and value >= 0 else "must be a non-negative integer"


# Field declarations for the families whose attention follows `layer_types` (Qwen2, Qwen3)
WINDOW_FIELDS: dict[str, Field] = {
    "use_sliding_window": mapped(),
    "sliding_window": mapped(_window_value),
    "max_window_layers": mapped(_max_window_layers),
    "layer_types": mapped(_layer_types),
}


def window_layers(hf: Mapping[str, Any]) -> tuple[int | None, tuple[int, ...] | None]:
    """(window, windowed layer indices): (None, None) without windows, (w, None) when every layer has one."""
    n = int(hf["num_hidden_layers"])
    w = hf.get("sliding_window")
    if not hf.get("use_sliding_window") or w is None:
        return None, None
    types = hf.get("layer_types")
    if types is None:
        first = int(hf.get("max_window_layers", 0) or 0)
        layers = tuple(i for i in range(n) if i >= first)
    else:
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if not layers:
        return None, None
    return int(w), (None if len(layers) == n else layers)


def window_skip_list(num_layers: int, layers: tuple[int, ...] | None) -> list[int] | None:
    """Megatron's `window_attn_skip_freq` as a list: entry i (layer i + 1) is 1 where the layer is windowed."""
    return None if layers is None else [int(i in layers) for i in range(num_layers)]
