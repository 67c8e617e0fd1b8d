"""Element-wise parts of the local-spec transformer layer fused by `torch.compile` (bf16 / fp16 only).

Why: in a bf16 fwd+bwd on CPU the matmuls are ~20% of the time; the rest is element-wise passes over
activations that eager PyTorch runs one op at a time (RMSNorm = cast, pow, mean, rsqrt, mul, mul, cast; SwiGLU =
chunk, silu, `x + 0.0`, mul; RoPE = mul, chunk, neg, cat, mul, add), each reading and writing the whole
tensor, and as many again in backward (profile in docs/performance.md). Compiled, each of these becomes one
generated loop forward and one backward, with bf16 <-> fp32 conversions kept in registers.

Only the element-wise functions are compiled, never Megatron's modules: Megatron's linear layers graph-break
under dynamo (measured: a whole compiled TransformerLayer splits into many graphs and runs slower). Shapes
are dynamic from the first call (a static first compile recompiled for each new length, batch-1 case and grad mode
until dynamo's limit of 8, then ran eager): one graph per grad mode and batch-1 case, whatever the lengths.

fp32 models keep Megatron's eager modules untouched (the exactness tests compare them to transformers at
~1e-5). On CUDA `model.compile=auto` leaves them eager too: there the GPU runs eager element-wise kernels fast and
the compiled calls' host-side cost made a bf16 step slower (trainer/setup.resolve_compile), except in the LM head's
log-prob kernels, a few calls over GiB chunks, which compile there too (`head_compile_enabled`).
`model.compile=false` (BuildConfig.compile; `set_compile`) turns the fused path off for the process:
the model's norms/MLPs, RoPE and the log-softmax all run eager (debugging, or bitwise Megatron in bf16). A machine
without a C++ compiler needs no switch: it falls back to eager by itself, with one warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import MethodType

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)
_BROKEN: dict[str, str] = {}  # function name -> why compiling it failed (it runs eager from then on)
_COMPILED_CALLS: dict[str, int] = {}  # function name -> calls that ran the compiled version
# process-wide like the Megatron RoPE hook it guards (compat/rope.py); set from model.compile by build_gpt_model
_ENABLED = True
_HEAD_ENABLED = True  # the LM head's log-prob kernels (policy/chunked_head.py, policy/logprobs.py)


def set_compile(enabled: bool, head: bool | None = None) -> None:
    """model.compile: the compiled element-wise ops (True, the default) or eager PyTorch (False); `head` (default:
    as `enabled`) switches the LM head's log-prob kernels on their own (trainer/setup.resolve_head_compile)."""
    global _ENABLED, _HEAD_ENABLED
    _ENABLED = bool(enabled)
    _HEAD_ENABLED = bool(enabled if head is None else head)


def compile_enabled() -> bool:
    return _ENABLED


def head_compile_enabled() -> bool:
    return _HEAD_ENABLED


def fallbacks() -> dict[str, str]:
    """Compiled functions that fell back to eager in this process, with the compile error: empty where the
    compiled path works (a C++ toolchain present), so a test can tell a real fused run from a silent eager one."""
    return dict(_BROKEN)


def compiled_calls() -> dict[str, int]:
    """How many calls of each function ran its compiled version (eager calls, fallbacks included, are not counted)."""
    return dict(_COMPILED_CALLS)


def _compiled(fn: Callable, enabled: Callable[[], bool] = compile_enabled) -> Callable:
    """torch.compile(fn), falling back to eager fn (once, logged) if compilation fails on this machine; eager
    whenever `enabled()` (its switch, read at each call) is off."""
    compiled = torch.compile(fn, dynamic=True)

    def call(*args, **kwargs):
        if fn.__name__ in _BROKEN or not enabled():
            return fn(*args, **kwargs)
        try:
            out = compiled(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - inductor needs a C++ toolchain; eager is always correct
            _BROKEN[fn.__name__] = f"{type(e).__name__}: {e}"
            log.warning("torch.compile of %s failed (%s: %s); using eager", fn.__name__, type(e).__name__, e)
            return fn(*args, **kwargs)
        _COMPILED_CALLS[fn.__name__] = _COMPILED_CALLS.get(fn.__name__, 0) + 1
        return out

    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # statistics in fp32 (as transformers' Llama/SmolLM2 RMSNorm), output in the activation dtype
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def _swiglu(x: Tensor) -> Tensor:
    gate, up = torch.chunk(x, 2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(x.dtype)


def _rope(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = torch.chunk(t, 2, dim=-1)
    return t * cos + torch.cat((-x2, x1), dim=-1) * sin


rms_norm = _compiled(_rms_norm)
swiglu = _compiled(_swiglu)
rope = _compiled(_rope)


def _norm_forward(self, x: Tensor) -> Tensor:
    return rms_norm(x, self.weight, self.eps if self.eps is not None else torch.finfo(x.dtype).eps)


def _mlp_forward(self, hidden_states: Tensor, per_token_scale=None, **kwargs):
    """Megatron MLP.forward for the gated-SiLU, bias-free case (the one `fuse_model` accepts)."""
    if per_token_scale is not None:
        raise ValueError("fused MLP: per_token_scale (MoE expert weighting) is not supported")
    inter, _ = self.linear_fc1(hidden_states)
    return self.linear_fc2(swiglu(inter))


def fuse_model(model: torch.nn.Module) -> dict[str, int]:
    """Route a bf16/fp16 local-spec GPTModel's RMSNorms and SwiGLU MLPs through the compiled functions.

    Instance-level forward swaps: parameters, state dicts and checkpoints are unchanged. Returns the counts
    swapped (logged; tests assert them). No-op for fp32 models or with model.compile=false.
    """
    from megatron.core.transformer.mlp import MLP

    counts = {"rms_norm": 0, "swiglu": 0}
    if not compile_enabled():
        log.warning("fused_ops: eager element-wise ops (model.compile=false, or auto on CUDA; no modules swapped)")
        return counts
    for m in model.modules():
        if type(m) is torch.nn.RMSNorm and m.elementwise_affine:
            m.forward = MethodType(_norm_forward, m)
            counts["rms_norm"] += 1
        elif type(m) is MLP:
            c = m.config
            if (c.gated_linear_unit and c.activation_func is F.silu and not c.add_bias_linear
                    and c.activation_func_clamp_value is None and c.glu_linear_offset == 0.0
                    and not c.use_te_activation_func):
                m.forward = MethodType(_mlp_forward, m)
                counts["swiglu"] += 1
    log.warning("fused_ops: compiled element-wise ops, swapped %s", counts)  # shown by default, as dtype=auto
    return counts
