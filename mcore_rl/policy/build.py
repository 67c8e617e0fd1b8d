"""Build the Megatron GPTModel for this rank's pipeline stage, wrap it in Megatron DDP, make its optimizer."""

from __future__ import annotations

import logging

import torch

from mcore_rl.config.model import LoraConfig
from mcore_rl.config.optim import OptimSettings
from mcore_rl.models.base import ModelArgs
from mcore_rl.models.moe_spec import moe_config_kwargs, moe_layer_spec, validate_moe_parallel
from mcore_rl.models.rope import set_rotary
from mcore_rl.models.spec import (
    BuildConfig,
    ddp_config_kwargs,
    fusion_kwargs,
    layer_spec,
    padded_vocab_size,
    resolve_impl,
    transformer_config_kwargs,
    validate_parallel,
)
from mcore_rl.policy.lora import attach_adapters


def _finalize_without_token_scaling(model, num_tokens=None, *args, **kwargs):
    """Megatron's grad finalisation, minus its division by the token count: our losses arrive pre-normalised."""
    from megatron.core.distributed import finalize_model_grads

    return finalize_model_grads(model, None, *args, **kwargs)


def transformer_config_dict(args: ModelArgs, build: BuildConfig, impl: str, trainable: bool = True) -> dict:
    """Everything TransformerConfig gets, as a dict (testable on CPU for the TE spec without building TE)."""
    kwargs = transformer_config_kwargs(args, build)
    kwargs.update(fusion_kwargs(impl, trainable, args.activation))  # Megatron/TE fused kernels: TE spec only
    kwargs.update(moe_config_kwargs(args, build.ep, build.moe_aux_loss_coeff))  # {} for dense models
    return kwargs


def build_transformer_config(args: ModelArgs, build: BuildConfig, trainable: bool = True):
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(**transformer_config_dict(args, build, resolve_impl(build), trainable))
    config.finalize_model_grads_func = _finalize_without_token_scaling
    config.variable_seq_lengths = build.pp > 1  # token-budget micro-batches differ in shape; p2p sends shapes
    return config


def build_gpt_model(
    args: ModelArgs, build: BuildConfig, *, wrap_ddp: bool = True, use_distributed_optimizer: bool = False,
    trainable: bool = True, lora: LoraConfig | None = None, seed: int = 0,
):
    """GPTModel for this rank's PP stage (TP-sharded), optionally wrapped for mixed precision and DDP.

    `trainable=False` (reference, old-logit models: forward only) skips DDP, whose contiguous fp32 gradient
    buffers (`main_grad`, one fp32 copy of every parameter) would be allocated for a model that never trains,
    and freezes the parameters so autograd keeps no graph for them. `lora`: adapters, base weights frozen."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    validate_parallel(args, build.tp, build.pp, torch.distributed.get_world_size())
    validate_moe_parallel(args, build.tp, build.ep, torch.distributed.get_world_size(), build.pp)
    impl = resolve_impl(build)
    config = build_transformer_config(args, build, trainable)
    sp = config.sequence_parallel
    spec = moe_layer_spec(args, impl, sequence_parallel=sp) if args.moe else layer_spec(args, impl, sp)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(args.vocab_size, build.tp),
        max_sequence_length=args.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=args.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(args.rope_theta),
    )
    set_rotary(model, args.rope, args.head_dim)  # HF's RoPE variant (models/rope.py), before any forward
    if lora is not None and lora.enabled:
        attach_adapters(model, lora, seed)  # before DDP: grad buffers and optimizer state hold adapters only
    model.lm_head_fp32 = build.lm_head_fp32  # read by the scored-token LM head (policy/step.py)
    from mcore_rl.compat import fused_ops

    # also RoPE (compat/rope.py); the LM head's log-prob kernels follow their own switch
    fused_ops.set_compile(build.compile, head=build.compile_head)
    if (config.bf16 or config.fp16) and impl == "local":
        # compiled RMSNorm / SwiGLU (RoPE and the log-softmax follow the dtype by themselves); fp32 stays eager
        model.fused_ops = fused_ops.fuse_model(model)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if config.bf16 or config.fp16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    if not trainable:
        return freeze(model)
    if not wrap_ddp:
        return model
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(**ddp_config_kwargs(impl, use_distributed_optimizer))
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    if ddp_config.overlap_grad_reduce:
        # Megatron's schedules hold the bucket reduces back until the last micro-batch through these
        config.no_sync_func = ddp.no_sync
        config.grad_sync_func = ddp.start_grad_sync
    return ddp


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """Forward-only: no parameter requires a gradient (no DDP wrapper, no optimizer: see build_gpt_model)."""
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    return model


def build_optimizer(model, build: BuildConfig, optim: OptimSettings, decay_steps: int, seed: int = 0):
    """Megatron's AdamW over `model` plus its LR/WD scheduler. `optim` is the `optim.*` Hydra group's dataclass
    itself (one definition of the keys); `decay_steps` is the schedule's length, which the trainer takes from
    trainer.steps rather than from a key of its own."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    cfg = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=build.dtype == "bf16",
        fp16=build.dtype == "fp16",
        params_dtype=torch.float32,
        use_distributed_optimizer=optim.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(cfg, [model])
    use_fused_cpu_adam(optimizer)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.warmup_steps else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.warmup_steps,
        lr_decay_steps=max(decay_steps, optim.warmup_steps + 1),
        lr_decay_style=optim.decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    if build.dtype == "bf16":
        from mcore_rl.policy.stochastic_round import enable_bf16_stochastic_rounding

        sr = optim.bf16_stochastic_rounding and enable_bf16_stochastic_rounding(
            optimizer, seed, lambda: scheduler.num_steps) > 0
        logging.getLogger("mcore_rl").warning(
            "bf16 master -> model weight copy: %s", "stochastic rounding" if sr else "round-to-nearest")
    return optimizer, scheduler


def use_fused_cpu_adam(optimizer) -> int:
    """Switch torch's Adam/AdamW under Megatron's optimizer to its fused CPU kernel (returns groups switched).

    Why: without Apex/TE, Megatron falls back to `torch.optim.AdamW` with its defaults, which on CPU is the
    single-tensor loop: ~10 element-wise passes per parameter tensor. `fused=True` (a CPU kernel since torch 2.4)
    does the whole update in one pass: measured 5-10x faster on SmolLM2's 135M fp32 master params, same update
    to ~1 ulp. Only where every parameter is on CPU (GPU runs keep TE/Apex FusedAdam or torch's own choice).
    """
    n = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            if all(p.device.type == "cpu" for p in group["params"]) and not group.get("fused"):
                group["fused"], group["foreach"] = True, False
                n += 1
    return n


def unwrap(model) -> torch.nn.Module:
    """DDP / Float16Module -> the GPTModel underneath."""
    while hasattr(model, "module"):
        model = model.module
    return model
