"""HF activations map to functions that are bitwise HF's own, and the TE build keeps Megatron's fused
bias-activation kernel (SwiGLU / tanh-GeGLU only) off for every activation it would compute differently."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.models.activations import ACTIVATIONS
from mcore_rl.models.spec import fusion_kwargs


@pytest.mark.parametrize("name", ACTIVATIONS.names())
def test_activation_is_hf_function_bitwise(name):
    from transformers.activations import ACT2FN

    x = torch.linspace(-6, 6, 1001)
    assert torch.equal(ACTIVATIONS.get(name).fn(x), ACT2FN[name](x))


@pytest.mark.parametrize("name,fused", [("silu", True), ("gelu", False), ("gelu_pytorch_tanh", False), ("relu", False)])
def test_te_fusion_only_where_exact(name, fused):
    assert fusion_kwargs("transformer_engine", True, name)["bias_activation_fusion"] is fused
    assert fusion_kwargs("local", True, name)["bias_activation_fusion"] is False


def test_megatron_fused_kernel_would_refuse_or_change_non_silu():
    """Why the switch exists: with fusion on, Megatron's MLP runs F.gelu as a tanh-approximated GeGLU, not the erf
    GELU that HF's `gelu` computes (and it raises for any other non-SiLU function)."""
    from megatron.core.fusions.fused_bias_geglu import bias_geglu_impl

    y = torch.randn(4, 16)
    gate, up = y.chunk(2, -1)
    assert (bias_geglu_impl(y, None) - ACTIVATIONS.get("gelu").fn(gate) * up).abs().max() > 1e-5
