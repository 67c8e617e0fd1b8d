"""SGLang's plain (not flattened) weight-update payloads: one tensor list per engine TP rank, names/dtypes/shapes per
tensor. The trainer always sends flattened buckets (mcore_rl/rollout/sglang/weight_transfer.py); SGLang, and so
mcore-rl-serve, also accept this plain form, which these builders let the contract tests send."""

from __future__ import annotations

from typing import Any

import torch

from mcore_rl.rollout.sglang.api import patch_torch_reductions, serialize_named_tensors


def serialize_per_rank(
    bucket: list[tuple[str, torch.Tensor]], devices: list[torch.device]
) -> tuple[list[str], list[list[tuple[str, torch.Tensor]]]]:
    """One payload per engine TP rank, each made from a copy on that rank's own device.

    Why per rank: engine TP rank i opens the IPC handles on its own GPU; a handle made on another device would
    make every rank read from GPU 0. Colocated only: the handles are valid on this node and only while the
    copies live, so they are returned too; the caller holds them until the server has answered.
    """
    patch_torch_reductions()
    # copy=True: sharing moves a CPU tensor's storage into shared memory in place; never do that to a parameter
    copies = [[(name, t.detach().to(dev, copy=True)) for name, t in bucket] for dev in devices]
    return [serialize_named_tensors(c) for c in copies], copies


def tensor_update_payload(
    serialized_per_rank: list[str], version: int | None, flush_cache: bool = True
) -> dict[str, Any]:
    """/update_weights_from_tensor body: one serialized bucket per engine TP rank."""
    out: dict[str, Any] = {"serialized_named_tensors": serialized_per_rank, "flush_cache": flush_cache}
    if version is not None:
        out["weight_version"] = str(version)
    return out


def distributed_update_payload(
    bucket: list[tuple[str, torch.Tensor]], group_name: str, version: int | None, flush_cache: bool
) -> dict[str, Any]:
    """/update_weights_from_distributed body announcing the tensors rank 0 is about to broadcast."""
    out: dict[str, Any] = {
        "names": [n for n, _ in bucket],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "group_name": group_name,
        "flush_cache": flush_cache,
    }
    if version is not None:
        out["weight_version"] = str(version)
    return out
