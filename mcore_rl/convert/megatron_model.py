"""Build this rank's Megatron GPTModel for conversion / verification, and run a plain logits forward on it.

Both users overwrite every parameter right after building (from HF weights or a checkpoint), so Megatron's random
initialisation -- most of the build time on CPU -- is skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from mcore_rl.distributed import all_gather
from mcore_rl.models.base import ModelArgs


@contextmanager
def without_random_init() -> Iterator[None]:
    """Build with TransformerConfig.perform_initialization=False (weights stay torch.empty, never touched).

    Stopgap: BuildConfig has no switch for it yet, so the kwargs builder seen by `policy.build` is wrapped for the
    duration of one build (conversion processes only).
    """
    from mcore_rl.policy import build

    original = build.transformer_config_kwargs

    def kwargs(args, cfg):
        return {**original(args, cfg), "perform_initialization": False}

    build.transformer_config_kwargs = kwargs
    try:
        yield
    finally:
        build.transformer_config_kwargs = original


def mark_tensor_parallel_weights(model) -> None:
    """On the CPU path Megatron sets a weight's tensor-parallel attributes only inside its random init, which we
    skip; weight loading needs them to slice, so set them as the init would (columns: dim 0, rows: dim 1)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    dims = ((ColumnParallelLinear, 0), (VocabParallelEmbedding, 0), (RowParallelLinear, 1))
    for module in model.modules():
        weight = getattr(module, "weight", None)
        dim = next((d for cls, d in dims if isinstance(module, cls)), None)
        if dim is not None and isinstance(weight, torch.nn.Parameter) and not hasattr(weight, "partition_dim"):
            set_tensor_model_parallel_attributes(weight, True, dim, 1)


def build_model(args: ModelArgs, tp: int, pp: int, dtype: str, ep: int = 1):
    """Unwrapped (no DDP, no grad buffers) GPTModel shard for this rank, uninitialised (a reward model's with its
    score head)."""
    from mcore_rl.models.spec import BuildConfig
    from mcore_rl.policy.build import build_gpt_model

    # local spec: same checkpoint keys as Transformer Engine's, and it runs on any machine
    cfg = BuildConfig(dtype=dtype, tp=tp, pp=pp, ep=ep, transformer_impl="local")
    with without_random_init():
        model = build_gpt_model(args, cfg, wrap_ddp=False)
    if args.num_labels:  # a reward model: the output layer is its score head (models/seq_cls.py)
        from mcore_rl.policy.score_model import attach_score_head

        attach_score_head(model, args)
    mark_tensor_parallel_weights(model)
    return model


@torch.no_grad()
def forward_logits(model, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Full-vocab logits [b, s, vocab_size] (fp32) on the last pipeline stage, None elsewhere."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mcore_rl.policy.build import unwrap

    unwrap(model).eval()
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    positions = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)

    def gather_vocab(logits: torch.Tensor) -> torch.Tensor:
        tp = ps.get_tensor_model_parallel_world_size()
        if tp > 1:
            logits = torch.cat(all_gather(logits, ps.get_tensor_model_parallel_group()), dim=-1)
        return logits[..., :vocab_size].float().cpu()  # drop TP vocab padding rows

    def loss_func(logits: torch.Tensor):
        return logits.new_zeros(()), torch.tensor(1), {"logits": gather_vocab(logits)}

    def forward_step(data_iterator, chunk):
        return chunk(next(data_iterator), positions, None), loss_func

    out = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([tokens]),
        model=[model],
        num_microbatches=1,
        seq_length=tokens.shape[1],
        micro_batch_size=tokens.shape[0],
        forward_only=True,
    )
    return out[0]["logits"] if ps.is_pipeline_last_stage() else None
