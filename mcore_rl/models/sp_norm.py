"""Torch RMSNorm/LayerNorm for the local layer spec that also runs under sequence parallelism.

Why: Megatron's `WrappedTorchNorm` (the local spec's norm without Apex) refuses `sequence_parallel`, so on CPU a
sequence-parallel build needed Transformer Engine. A norm is per token, so it runs unchanged on a sequence shard;
what sequence parallelism changes is its weight gradient, which then covers this rank's tokens only. Megatron's
answer (TE and Apex norms do the same) is the `sequence_parallel` attribute on the weight: finalize_model_grads sums
such gradients over the tensor-parallel group. Same module (torch.nn.RMSNorm), same parameter names and numbers.
"""

from __future__ import annotations

import torch


class TorchNorm:
    """Build-time factory with WrappedTorchNorm's signature: returns torch.nn.RMSNorm / LayerNorm, its parameters
    marked `sequence_parallel` when the config is."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused) -> torch.nn.Module:
        kinds = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}
        if config.normalization not in kinds:
            raise ValueError(
                f"normalization={config.normalization!r}: the local spec supports {sorted(kinds)}"
            )
        norm = kinds[config.normalization](hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


def swap_norms(spec) -> None:
    """Replace WrappedTorchNorm by TorchNorm everywhere in a (nested) ModuleSpec, in place."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    subs = getattr(spec, "submodules", None)
    if subs is None:
        return
    for field in vars(subs):
        value = getattr(subs, field)
        if value is WrappedTorchNorm:
            setattr(subs, field, TorchNorm)
        elif isinstance(value, ModuleSpec):
            swap_norms(value)


def sequence_parallel_block(layer, num_layers: int):
    """The block spec of this pipeline stage: `layer` (its norms swapped) repeated, and a TorchNorm final norm
    (Megatron builds the final norm from its own default, which refuses sequence parallelism)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    swap_norms(layer)
    per_stage = num_layers // ps.get_pipeline_model_parallel_world_size()
    return TransformerBlockSubmodules(layer_specs=[layer] * per_stage, layer_norm=TorchNorm)
