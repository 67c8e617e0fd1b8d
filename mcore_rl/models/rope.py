"""RoPE variants of HF configs (`rope_type` default, linear, llama3, yarn) as Megatron rotary frequencies.

Why our own frequencies rather than Megatron's options: Megatron's `rope_scaling` hard-codes Llama 3's constants
(low/high frequency factors 1/4, original context 8192) and has no linear or YaRN mode for a GPTModel, while real
checkpoints use other values (Llama 3.2: original context 8192 but small models ship with others; Qwen long-context
configs use YaRN). Every variant here only changes the per-dimension inverse frequencies (computed once, in fp32,
the way transformers computes them) plus, for YaRN, one "attention factor" that HF multiplies into cos and sin.
Scaling both q and k by m equals scaling the attention logits by m^2, so the factor becomes Megatron's
`softmax_scale` = m^2 / sqrt(head_dim): one TransformerConfig field that every attention implementation honours
(local, SDPA, Transformer Engine) and that leaves fused RoPE kernels untouched.

Anything else (dynamic NTK, LongRoPE, partial rotary) is refused by `rope_refusal` in one line.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from mcore_rl.registry import Registry


@dataclass(frozen=True)
class RopeArgs:
    """One model's rotary embedding: its type, base and the type's own parameters (HF spelling)."""

    kind: str = "default"
    theta: float = 10000.0
    params: dict[str, Any] = field(default_factory=dict)
    max_position_embeddings: int = 4096  # the model's (scaled) context; YaRN derives a missing factor from it


@dataclass(frozen=True)
class RopeType:
    """How one `rope_type` turns base frequencies into scaled ones, and which keys it reads."""

    keys: frozenset[str]
    required: frozenset[str]
    inv_freq: Callable[[torch.Tensor, RopeArgs, int], torch.Tensor]  # (base inv_freq, args, rotary dim)
    attention_factor: Callable[[RopeArgs], float] = lambda r: 1.0


ROPE_TYPES: Registry[RopeType] = Registry("rope_type")
_COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta"})


def _default(inv: torch.Tensor, r: RopeArgs, dim: int) -> torch.Tensor:
    return inv


def _linear(inv: torch.Tensor, r: RopeArgs, dim: int) -> torch.Tensor:
    """Position interpolation: every position divided by `factor`, i.e. every frequency."""
    return inv / float(r.params["factor"])


def _llama3(inv: torch.Tensor, r: RopeArgs, dim: int) -> torch.Tensor:
    """Llama 3.x: wavelengths longer than original_context/low_freq_factor are slowed by `factor`, shorter than
    original_context/high_freq_factor are kept, and the band in between is blended linearly in 1/wavelength."""
    p = r.params
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    context = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    slowed = torch.where(wavelen > context / low, inv / factor, inv)
    blend = (context / wavelen - low) / (high - low)
    smoothed = (1 - blend) * slowed / factor + blend * slowed
    middle = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(middle, smoothed, slowed)


def _yarn_factor(r: RopeArgs) -> float:
    f = r.params.get("factor")
    return (
        float(f)
        if f is not None
        else r.max_position_embeddings / float(r.params["original_max_position_embeddings"])
    )


def _yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn_attention_factor(r: RopeArgs) -> float:
    p, factor = r.params, _yarn_factor(r)
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    if p.get("mscale") and p.get("mscale_all_dim"):
        return _yarn_mscale(factor, float(p["mscale"])) / _yarn_mscale(factor, float(p["mscale_all_dim"]))
    return _yarn_mscale(factor)


def _yarn(inv: torch.Tensor, r: RopeArgs, dim: int) -> torch.Tensor:
    """YaRN (NTK-by-parts): dimensions that rotate fewer than beta_slow times over the original context are
    interpolated (divided by `factor`), more than beta_fast times are kept, with a linear ramp in between."""
    p, factor, base = r.params, _yarn_factor(r), r.theta
    context = float(p["original_max_position_embeddings"])
    fast, slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def dim_of(
        rotations: float,
    ) -> float:  # the dimension index that completes `rotations` turns over `context`
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = dim_of(fast), dim_of(slow)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    keep = 1 - ramp
    pos = 1.0 / inv  # base ** (2i / dim)
    return (1.0 / (factor * pos)) * (1 - keep) + (1.0 / pos) * keep


_LLAMA3_KEYS = frozenset(
    {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
)
ROPE_TYPES.add("default", RopeType(frozenset(), frozenset(), _default))
ROPE_TYPES.add("linear", RopeType(frozenset({"factor"}), frozenset({"factor"}), _linear))
ROPE_TYPES.add("llama3", RopeType(_LLAMA3_KEYS, _LLAMA3_KEYS, _llama3))
ROPE_TYPES.add(
    "yarn",
    RopeType(
        frozenset(
            {
                "factor",
                "attention_factor",
                "beta_fast",
                "beta_slow",
                "mscale",
                "mscale_all_dim",
                "original_max_position_embeddings",
                "truncate",
            }
        ),
        frozenset(),
        _yarn,
        _yarn_attention_factor,
    ),
)


def rope_dict(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The config's rope parameters in one dict (transformers >= 5 `rope_parameters`, older `rope_scaling`), with
    what transformers fills in itself: `original_max_position_embeddings` defaults to the model's context."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind in ("llama3", "yarn") and "original_max_position_embeddings" not in rope:
        ctx = hf.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
        if ctx is not None:
            rope["original_max_position_embeddings"] = ctx
    return rope


def rope_refusal(hf: Mapping[str, Any]) -> str | None:
    """Why this config's RoPE cannot be reproduced exactly, or None."""
    rope = rope_dict(hf)
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind not in ROPE_TYPES:
        return f"rope type {kind!r} is not implemented ({', '.join(ROPE_TYPES.names())})"
    spec = ROPE_TYPES.get(kind)
    extra = sorted(set(rope) - _COMMON_KEYS - spec.keys)
    if extra:
        return f"keys {extra} are not implemented for {kind} RoPE"
    missing = sorted(spec.required - set(rope))
    if missing:
        return f"{kind} RoPE needs {missing}"
    if kind == "yarn" and rope.get("factor") is None and "original_max_position_embeddings" not in rope:
        return "yarn RoPE needs factor or original_max_position_embeddings"
    return None


def rope_args(hf: Mapping[str, Any]) -> RopeArgs:
    rope = rope_dict(hf)
    kind = rope.get("rope_type", rope.get("type")) or "default"
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    params = {k: v for k, v in rope.items() if k not in _COMMON_KEYS}
    return RopeArgs(kind, float(theta), params, int(hf.get("max_position_embeddings", 4096)))


def inv_freq(r: RopeArgs, dim: int) -> torch.Tensor:
    """[dim // 2] fp32 inverse frequencies, the same formula and operation order as transformers'."""
    base = 1.0 / (r.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return ROPE_TYPES.get(r.kind).inv_freq(base, r, dim)


def attention_factor(r: RopeArgs) -> float:
    """The factor HF multiplies into cos and sin (1.0 except for YaRN)."""
    return float(ROPE_TYPES.get(r.kind).attention_factor(r))


def softmax_scale(r: RopeArgs, head_dim: int) -> float | None:
    """Megatron's `softmax_scale` reproducing the attention factor (None = Megatron's own 1/sqrt(head_dim))."""
    m = attention_factor(r)
    return None if m == 1.0 else m * m / math.sqrt(head_dim)


def set_rotary(model: torch.nn.Module, r: RopeArgs, dim: int) -> None:
    """Overwrite the GPTModel's rotary frequencies (every pipeline stage has its own `rotary_pos_emb`). Must run
    before the first forward: Megatron caches the embedding per sequence length."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None:
        return
    rotary.inv_freq = inv_freq(r, dim).to(rotary.inv_freq.device)
