"""HF `hidden_act` names -> the gated MLP activation Megatron applies, where both compute the same function.

HF's gated MLP is down(act(gate(x)) * up(x)); Megatron's `gated_linear_unit` MLP is fc2(act(x_gate) * x_up) with
fc1 = [gate; up], so any elementwise activation carries over as long as it is the same function. Megatron's fused
bias-activation kernels implement SwiGLU and a *tanh-approximated* GeGLU only: `fusable` says which activation may
use them without changing the math (the Transformer Engine build turns fusion off for the others).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mcore_rl.registry import Registry


@dataclass(frozen=True)
class Activation:
    fn: Callable[[torch.Tensor], torch.Tensor]
    fusable: bool = False  # Megatron's fused bias+activation kernel computes exactly this function


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """HF `gelu_pytorch_tanh` / `gelu_new`: PyTorch's tanh approximation of GELU."""
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: Registry[Activation] = Registry("hidden_act")
ACTIVATIONS.add("silu", Activation(F.silu, fusable=True))
ACTIVATIONS.add("swish", Activation(F.silu, fusable=True))
ACTIVATIONS.add("gelu", Activation(F.gelu))  # exact (erf) GELU; Megatron's fused GeGLU is the tanh one
ACTIVATIONS.add("gelu_pytorch_tanh", Activation(gelu_tanh))
ACTIVATIONS.add("relu", Activation(F.relu))


def activation_refusal(value, hf) -> str | None:
    if value in ACTIVATIONS:
        return None
    return f"only {', '.join(ACTIVATIONS.names())} are implemented"
