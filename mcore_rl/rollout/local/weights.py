"""In-place weight loading for the local engine: HF-named tensors copied into the live model's parameters."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

import torch

from mcore_rl.models.transformers_layout import expert_view


def load_named_tensors(
    params: dict[str, torch.Tensor], named_tensors: Iterable[tuple[str, torch.Tensor]]
) -> int:
    """Copy tensors into `params` (HF name -> live tensor) in place; error names the offending tensor.

    In place (never `load_state_dict`): the decode loop, and any compiled function, keep pointing at the same
    storage, so an update between two decode steps needs no re-wiring.
    """
    count = 0
    with torch.no_grad():
        for name, tensor in named_tensors:
            target = params.get(name)
            if target is None:  # MoE: a per-expert checkpoint name lands in a fused in-memory parameter
                target = expert_view(params, name)
            if target is None:
                close = difflib.get_close_matches(name, list(params), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise KeyError(f"update_weights: unknown tensor name {name!r}{hint}")
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"update_weights: shape mismatch for {name!r}: got {tuple(tensor.shape)}, "
                    f"model has {tuple(target.shape)}"
                )
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
            count += 1
    return count
