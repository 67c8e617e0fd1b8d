"""The engine's own decode-step forward for llama-family decoders (llama, mistral, qwen2, qwen3).

Why not the model's forward: a decode step feeds one token per row, so a small model's layer is ~20 tensor ops
of a few hundred microseconds each, and transformers' per-module code (mask building, cache dispatch, kwargs
plumbing, ~60 ops per layer) is a sizeable share of the step on a CPU. Here one layer is: RMSNorm, one GEMM for
q/k/v, RoPE on q and k together, one K/V column written in place into the engine's KV cache, one SDPA call with
the query heads of each KV head as the query rows (grouped-query attention without repeating K/V), o_proj, RMSNorm,
one GEMM for gate/up, the activation, down_proj.

The HF module stays the source of truth: its q/k/v (and gate/up) weights become row views of one fused buffer
per layer (`fuse`; or transposed column views of [in, out] buffers where this CPU multiplies that layout faster,
weight_layout.py), so an in-place weight update (`weights.load_named_tensors`) lands in the fused buffer with no
copy; `refresh` re-fuses any layer whose parameters were re-pointed (`module.to`, `.data =`). RoPE comes from the
model's own rotary embedding module (default, linear, dynamic, llama3, YaRN incl. its attention factor), RMSNorm,
activation, biases and qwen3's q/k norms from the model's own modules and constants. What the path does not
cover exactly (sliding windows, partial rotary, other families) is refused by `unsupported`, and the engine then
runs the model's own forward: never an approximation.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from mcore_rl.compat.bf16_matmul import WideWeights, routed, wide_linear
from mcore_rl.rollout.local.kv_cache import KVCache
from mcore_rl.rollout.local.lm_head import REGROUP_DTYPES

SKINNY_ROWS = 4  # at or below: weight @ x^T (see linear)
FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_LAYER_PARTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")  # fmt: skip


def unsupported(model: torch.nn.Module) -> str | None:
    """Why the fused forward does not reproduce this model exactly, or None when it does."""
    cfg = model.config
    if cfg.model_type not in FAMILIES:
        return f"model_type {cfg.model_type!r} is not one of {sorted(FAMILIES)}"
    if model.training:
        return "model is in training mode"
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not hasattr(model.model, "rotary_emb") or not hasattr(model.model, "norm"):
        return "no model.layers / rotary_emb / norm"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ["full_attention"])):
        return "sliding-window layers"
    if cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None) is not None:
        return "sliding window"
    for layer in layers:
        missing = [part for part in _LAYER_PARTS if not _has(layer, part)]
        if missing:
            return f"decoder layer without {missing[0]}"
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not all(map(_is_rms_norm, norms)):
            return "norm is not an RMSNorm"
    attn = layers[0].self_attn
    head_dim = attn.head_dim
    probe = torch.zeros(1, 1, head_dim, dtype=model.dtype, device=model.device)
    cos, _ = model.model.rotary_emb(probe, torch.zeros(1, 1, dtype=torch.long, device=model.device))
    if cos.shape[-1] != head_dim:
        return f"partial rotary ({cos.shape[-1]} of {head_dim} dims)"
    if abs(attn.scaling - head_dim**-0.5) > 0:
        return "non-standard attention scaling"
    return None


def _has(module: torch.nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def _is_rms_norm(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")


def rms_norm(x: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """transformers' RMSNorm op for op (fp32 statistics, scale in the input dtype)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    return module.weight * h.to(dtype)


@dataclass
class FusedLayer:
    """One decoder layer's decode weights. [out, in] layout: the HF q/k/v (gate/up) parameters are row views of
    `qkv` (`gate_up`), `o` and `down` are the HF weights themselves. [in, out] layout (`in_major`, weight_layout.py):
    every HF weight is a transposed view of its column slice of these buffers."""

    layer: torch.nn.Module
    in_major: bool
    qkv: torch.Tensor  # [(q_heads + 2 kv_heads) * head_dim, hidden], or its transpose when in_major
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor  # [2 * intermediate, hidden], or its transpose
    gate_up_bias: torch.Tensor | None
    o: torch.Tensor
    down: torch.Tensor

    def is_fused(self) -> bool:
        """True while every HF parameter still aliases the fused buffers (an in-place update keeps that)."""
        attn, mlp = self.layer.self_attn, self.layer.mlp
        return all(_aliases(buf, [lin.weight for lin in lins], self.in_major) for buf, lins in (
            (self.qkv, [attn.q_proj, attn.k_proj, attn.v_proj]), (self.gate_up, [mlp.gate_proj, mlp.up_proj]),
            (self.o, [attn.o_proj]), (self.down, [mlp.down_proj])))


def _aliases(fused: torch.Tensor, params: list[torch.Tensor], in_major: bool) -> bool:
    """Each parameter is its slice of `fused`: rows in [out, in], transposed columns in [in, out]."""
    ptr, row_bytes = fused.data_ptr(), fused.stride(0) * fused.element_size()
    for p in params:
        if p.data_ptr() != ptr or (in_major and p.stride() != (1, fused.stride(0))):
            return False
        ptr += p.shape[0] * (fused.element_size() if in_major else row_bytes)
    return True


def _fuse_params(params: list[torch.nn.Parameter], in_major: bool = False) -> torch.Tensor:
    """Concatenate (rows, or transposed as columns when in_major), then re-point every parameter at its slice of
    the result (same Parameter objects). A lone [out, in] parameter is used as it is."""
    if in_major:
        fused = torch.cat([p.detach().t() for p in params], dim=1).contiguous()
    elif len(params) == 1:
        return params[0].detach()
    else:
        fused = torch.cat([p.detach() for p in params])
    start = 0
    for p in params:
        n = p.shape[0]
        p.data = fused[:, start : start + n].t() if in_major else fused[start : start + n]
        start += n
    return fused


def fuse(layer: torch.nn.Module, in_major: bool = False) -> FusedLayer:
    attn, mlp = layer.self_attn, layer.mlp
    qkv_lin, gu_lin = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
    with torch.no_grad():
        qkv = _fuse_params([lin.weight for lin in qkv_lin], in_major)
        gate_up = _fuse_params([lin.weight for lin in gu_lin], in_major)
        o = _fuse_params([attn.o_proj.weight], in_major)
        down = _fuse_params([mlp.down_proj.weight], in_major)
        qkv_bias = _fuse_params([lin.bias for lin in qkv_lin]) if attn.q_proj.bias is not None else None
        gu_bias = _fuse_params([lin.bias for lin in gu_lin]) if mlp.gate_proj.bias is not None else None
    return FusedLayer(layer, in_major, qkv, qkv_bias, gate_up, gu_bias, o, down)


class DecodeForward:
    """`forward(tokens, positions, mask, cache)` -> final hidden state [B, hidden] of one decode step."""

    def __init__(self, model: torch.nn.Module, in_major: bool = False) -> None:
        reason = unsupported(model)
        if reason:
            raise ValueError(f"fused decode forward: {reason}")
        self.model, self.in_major = model, in_major
        self.layers = [fuse(layer, in_major) for layer in model.model.layers]
        attn = model.model.layers[0].self_attn
        cfg = model.config.get_text_config(decoder=True)
        self.head_dim = attn.head_dim
        self.q_heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.scaling = attn.scaling
        self.qk_norm = hasattr(attn, "q_norm")
        self.wide = WideWeights()  # fp32 copies for the fp32-GEMM bf16 route (compat/bf16_matmul.py), when on

    def refresh(self) -> int:
        """After a weight update: re-fuse layers whose parameters no longer alias the fused buffers (returns how
        many), and drop the bf16 route's fp32 copies (a parameter re-pointed at its slice of a fused buffer keeps
        its own version counter, so the copies cannot tell an in-place update happened)."""
        stale = [i for i, f in enumerate(self.layers) if not f.is_fused()]
        for i in stale:
            self.layers[i] = fuse(self.layers[i].layer, self.in_major)
        self.wide.clear()
        return len(stale)

    def set_layout(self, in_major: bool) -> None:
        """Store every layer's weights in the other layout (weight_layout.py); a no-op when already there."""
        if in_major != self.in_major:
            self.in_major = in_major
            self.layers = [fuse(f.layer, in_major) for f in self.layers]
            self.wide.clear()

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """tokens/positions [B]; mask [B, L+1] bool over the cache columns after this step's write."""
        m = self.model.model
        h = m.embed_tokens(tokens)  # [B, hidden]
        cos, sin = m.rotary_emb(h, positions.unsqueeze(1))  # [B, 1, head_dim], the model's own RoPE
        half = self.head_dim // 2
        rope = (cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:])
        bias = torch.zeros(mask.shape, dtype=h.dtype, device=h.device).masked_fill_(~mask, float("-inf"))
        bias = bias[:, None, None, :]  # [B, 1, 1, L]: additive, built once for every layer
        wide = self.wide if routed(h) else None
        for fused, layer in zip(self.layers, cache.layers):
            h = self._layer(fused, layer, h, rope, bias, wide)
        return rms_norm(h, m.norm)

    __call__ = forward

    def _layer(self, fused: FusedLayer, kv, h: torch.Tensor, rope, bias: torch.Tensor,
               wide: WideWeights | None) -> torch.Tensor:
        mod, b, d = fused.layer, h.shape[0], self.head_dim
        mm = in_major_linear if fused.in_major else linear
        if wide is not None:  # bf16 through fp32 GEMMs: on the cached fp32 copies
            mm = partial(wide_linear, wide=wide, in_major=fused.in_major)
        qkv = mm(rms_norm(h, mod.input_layernorm), fused.qkv, fused.qkv_bias)
        nq, nkv = self.q_heads, self.kv_heads
        qk = qkv[:, : (nq + nkv) * d].view(b, nq + nkv, d)
        v = qkv[:, (nq + nkv) * d :].view(b, nkv, 1, d)
        if self.qk_norm:  # qwen3: per-head RMSNorm of q and k before RoPE
            attn_mod = mod.self_attn
            qk = torch.cat([rms_norm(qk[:, :nq], attn_mod.q_norm), rms_norm(qk[:, nq:], attn_mod.k_norm)], 1)
        qk = _rope(qk, *rope)
        keys, values = kv.update(qk[:, nq:].unsqueeze(2), v)
        q = qk[:, :nq].reshape(b, nkv, nq // nkv, d)  # query heads of one KV head = its query rows
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=self.scaling)
        h = h + mm(attn.reshape(b, nq * d), fused.o, mod.self_attn.o_proj.bias)
        gu = mm(rms_norm(h, mod.post_attention_layernorm), fused.gate_up, fused.gate_up_bias)
        inter = gu.shape[1] // 2
        return h + mm(mod.mlp.act_fn(gu[:, :inter]) * gu[:, inter:], fused.down, mod.mlp.down_proj.bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T (+ bias). On a CPU with <= SKINNY_ROWS rows as weight @ x^T, one row fed twice: MKL's GEMM
    for a 1-4 row `x @ W^T` is far below the memory bandwidth, `W @ x^T` with 2 rows streams W at it (SmolLM2's 30
    layers, fp32, 1 thread: 1 row 42 -> 25 ms, 2 rows 70 -> 25 ms, 4 rows 55 -> 45 ms; from 8 rows on the plain
    product is as fast). Same dot products, regrouped: equal to float rounding. In the REGROUP_DTYPES only (fp32):
    bf16's GEMM runs 1-4 rows of `x @ W^T` 1.5-1.7x faster than `W @ x^T` (lm_head.py has the numbers)."""
    rows = x.shape[0]
    if x.device.type != "cpu" or rows > SKINNY_ROWS or x.dtype not in REGROUP_DTYPES:
        return F.linear(x, weight, bias)
    xt = x.expand(2, -1).contiguous().t() if rows == 1 else x.t()
    out = torch.mm(weight, xt).t()[:rows].contiguous()
    return out if bias is None else out.add_(bias)


def in_major_linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight_t (+ bias) with weight_t stored [in, out] (weight_layout.py: where this CPU runs it faster)."""
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


def _rope(x: torch.Tensor, cos1, cos2, sin1, sin2) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, written per half (the same products and sums as transformers')."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty_like(x)
    torch.sub(x1 * cos1, x2 * sin1, out=out[..., :half])
    torch.add(x2 * cos2, x1 * sin2, out=out[..., half:])
    return out
