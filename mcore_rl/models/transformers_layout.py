"""HF checkpoint names -> tensors of a live transformers model whose in-memory layout differs from its checkpoint.

transformers >= 5 keeps MoE experts fused in memory (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I]) while checkpoints, SGLang and our adapters name them one by one (`mlp.experts.<e>.gate_proj.weight`).
An engine that copies HF-named tensors into a live model asks here for the view a checkpoint name lands in.
"""

from __future__ import annotations

import re

import torch

_CKPT_EXPERT = re.compile(r"^(?P<base>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def expert_view(params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The slice of a fused expert parameter that checkpoint tensor `name` fills, or None if not applicable."""
    m = _CKPT_EXPERT.match(name)
    if not m:
        return None
    e, proj = int(m.group("e")), m.group("proj")
    if proj == "down_proj":
        fused = params.get(f"{m.group('base')}.down_proj")
        return None if fused is None or e >= fused.shape[0] else fused[e]
    fused = params.get(f"{m.group('base')}.gate_up_proj")
    if fused is None or e >= fused.shape[0]:
        return None
    gate, up = fused[e].chunk(2, dim=0)  # HF order: [gate; up]
    return gate if proj == "gate_proj" else up
