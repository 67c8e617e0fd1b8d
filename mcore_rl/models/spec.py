"""ModelArgs + run settings -> Megatron TransformerConfig and layer spec (TE on GPU when installed, local otherwise)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import torch

from mcore_rl.config.model import Fp8Config  # noqa: F401  (the schema of model.fp8; re-exported)
from mcore_rl.dtypes import SHORT, torch_dtype
from mcore_rl.models.activations import ACTIVATIONS
from mcore_rl.models.base import ModelArgs
from mcore_rl.models.rope import softmax_scale
from mcore_rl.models.windows import window_skip_list

FP8_FORMATS = ("hybrid", "e4m3")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


@dataclass
class BuildConfig:
    """How to build the policy network, independent of which HF family it came from."""

    dtype: str = "fp32"  # fp32 | bf16 | fp16
    transformer_impl: str = "auto"  # auto (TE if importable and CUDA) | local | transformer_engine
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    fp8: Fp8Config = field(default_factory=Fp8Config)
    init_std: float = 0.02
    recompute_activations: bool = False
    ep: int = 1  # expert-parallel ranks (MoE models only; see models/moe_spec.py)
    moe_aux_loss_coeff: float = 0.0  # MoE load-balancing loss weight (0 = off, the RL default)
    # bf16/fp16: run the LM head (the vocab-sized matmul) in fp32, as ScaleRL does: bf16 logits of magnitude ~20
    # are rounded by ~0.05, the largest single source of bf16-vs-fp32 log-prob error; costs fp32 speed on it
    lm_head_fp32: bool = False
    # bf16/fp16: torch.compile the element-wise ops (compat/fused_ops.py); False = eager PyTorch (model.compile,
    # resolved per device by trainer/setup.resolve_compile)
    compile: bool = True
    # the LM head's log-prob kernels (policy/chunked_head.py, policy/logprobs.py): compiled wherever model.compile
    # is not false, on CUDA too, where the layers' ops run eager (trainer/setup.resolve_head_compile); None: as compile
    compile_head: bool | None = None


def te_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def resolve_impl(build: BuildConfig) -> str:
    """Pick the layer implementation and fail fast, in one line, on settings that cannot work."""
    impl = build.transformer_impl
    if impl not in ("auto", "local", "transformer_engine"):
        raise ValueError(f"model.transformer_impl={impl!r}: expected auto, local or transformer_engine")
    if impl == "auto":
        impl = "transformer_engine" if te_available() else "local"
    if impl == "transformer_engine" and not te_available():
        raise RuntimeError(
            "model.transformer_impl=transformer_engine needs Transformer Engine and CUDA "
            "(pip install 'mcore-rl[gpu]' on a GPU machine); use transformer_impl=local on CPU"
        )
    if build.fp8.enabled and impl != "transformer_engine":
        raise RuntimeError(
            "model.fp8.enabled=true needs Transformer Engine (FP8 GEMMs exist only in TE); "
            "install mcore-rl[gpu] on a GPU machine or set model.fp8.enabled=false"
        )
    return impl


def validate_parallel(a: ModelArgs, tp: int, pp: int, world_size: int | None = None) -> None:
    """Divisibility checks with the numbers in the message, before any heavy work."""
    if tp < 1 or pp < 1:
        raise ValueError(f"parallel.tp={tp} and parallel.pp={pp} must be >= 1")
    if a.num_attention_heads % tp:
        raise ValueError(f"parallel.tp={tp} does not divide num_attention_heads={a.num_attention_heads}")
    if a.num_query_groups % tp:
        raise ValueError(f"parallel.tp={tp} does not divide num_query_groups (KV heads)={a.num_query_groups}")
    if a.num_layers % pp:
        raise ValueError(f"parallel.pp={pp} does not divide num_layers={a.num_layers}")
    if world_size is not None and world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by tp*pp={tp}*{pp}={tp * pp}")


def fp8_fields(fp8: Fp8Config) -> dict:
    if not fp8.enabled:
        return {"fp8": None}
    if fp8.format not in FP8_FORMATS:
        raise ValueError(f"model.fp8.format={fp8.format!r}: expected one of {FP8_FORMATS}")
    if fp8.recipe not in FP8_RECIPES:
        raise ValueError(f"model.fp8.recipe={fp8.recipe!r}: expected one of {FP8_RECIPES}")
    if fp8.amax_compute_algo not in ("max", "most_recent"):
        raise ValueError(f"model.fp8.amax_compute_algo={fp8.amax_compute_algo!r}: expected max or most_recent")
    return {
        "fp8": fp8.format,
        "fp8_recipe": fp8.recipe,
        "fp8_amax_history_len": fp8.amax_history_len,
        "fp8_amax_compute_algo": fp8.amax_compute_algo,
        "fp8_margin": fp8.margin,
        "fp8_param": fp8.fp8_param,
    }


def transformer_config_kwargs(a: ModelArgs, build: BuildConfig) -> dict:
    """Keyword arguments for megatron.core TransformerConfig (kept as a dict so it is testable without Megatron)."""
    if build.dtype not in SHORT:
        raise ValueError(f"model.dtype={build.dtype!r}: expected one of {', '.join(SHORT)}")
    dtype = torch_dtype(build.dtype)
    kw = dict(
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        ffn_hidden_size=a.ffn_hidden_size,
        num_attention_heads=a.num_attention_heads,
        num_query_groups=a.num_query_groups,
        kv_channels=a.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=a.norm_eps,
        gated_linear_unit=True,
        activation_func=ACTIVATIONS.get(a.activation).fn,
        add_bias_linear=a.linear_bias,
        add_qkv_bias=a.qkv_bias,
        qk_layernorm=a.qk_norm,
        softmax_scale=softmax_scale(a.rope, a.head_dim),  # YaRN's attention factor (models/rope.py)
        # HF's window w: keys i - w < j <= i, i.e. w - 1 to the left (Megatron/TE's (left, right) convention)
        window_size=(a.sliding_window - 1, 0) if a.sliding_window else None,
        window_attn_skip_freq=window_skip_list(a.num_layers, a.window_layers),  # per-layer windows (Qwen2/3)
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=build.init_std,
        # fusions are CUDA kernels, off here (the local/CPU spec); fusion_kwargs turns them on for TE
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=build.tp,
        pipeline_model_parallel_size=build.pp,
        sequence_parallel=build.sequence_parallel and build.tp > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        # we pre-normalise every micro-batch loss by global denominators; Megatron must not re-average
        calculate_per_token_loss=True,
        use_cpu_initialization=not torch.cuda.is_available(),
        recompute_granularity="selective" if build.recompute_activations else None,
    )
    kw.update(fp8_fields(build.fp8))
    return kw


# Megatron's fused kernels, on with the Transformer Engine spec (resolve_impl picks it only where TE and CUDA are
# both present). bias_activation_fusion: fused SwiGLU; masked_softmax_fusion: Megatron's fused softmax (TE's own
# attention ignores it); apply_rope_fusion: TE's fused RoPE; bias_dropout_fusion: fused bias-dropout-add;
# gradient_accumulation_fusion: weight gradients accumulated straight into DDP's fp32 main_grad by the GEMM
# (trainable models only: a frozen model has no main_grad to accumulate into).
TE_FUSIONS = ("bias_activation_fusion", "masked_softmax_fusion", "apply_rope_fusion", "bias_dropout_fusion")


def fusion_kwargs(impl: str, trainable: bool = True, activation: str = "silu") -> dict:
    """TransformerConfig fusion switches for the chosen layer implementation. The fused bias-activation kernel
    stays off for activations it does not compute exactly (models/activations.py)."""
    on = impl == "transformer_engine"
    kw = {**{k: on for k in TE_FUSIONS}, "gradient_accumulation_fusion": on and trainable}
    kw["bias_activation_fusion"] = on and ACTIVATIONS.get(activation).fusable
    return kw


def ddp_config_kwargs(impl: str, use_distributed_optimizer: bool) -> dict:
    """DistributedDataParallelConfig for a trainable model. With TE on CUDA the gradient reduce-scatter/all-reduce
    overlaps the backward pass (bucket by bucket); CPU/gloo runs keep one synchronous reduce after it.

    overlap_param_gather stays off even with the distributed optimizer: it defers the post-step all-gather of
    updated weights to the next forward's pre-hooks, and this trainer reads the weights right after each step
    outside any forward (weight sync to the engine, PPO-EWMA, the old-logit model's copy), which would see the
    previous step's shards."""
    return dict(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=impl == "transformer_engine",
        overlap_param_gather=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )


def layer_spec(a: ModelArgs, impl: str, sequence_parallel: bool = False):
    """The dense layer spec; `sequence_parallel` (TP > 1) on the local spec swaps in norms that support it."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if impl == "transformer_engine":
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=a.qk_norm)
    from mcore_rl.compat import rope
    from mcore_rl.models.sdpa_attention import use_sdpa

    rope.install()  # cos/sin once per forward instead of per layer; same numbers as Megatron's unfused RoPE

    # Megatron's local attention is unfused; SDPA computes the same softmax(QK^T)V in one fused kernel
    spec = use_sdpa(specs.get_gpt_layer_local_spec(qk_layernorm=a.qk_norm, normalization="RMSNorm"))
    if sequence_parallel:
        from mcore_rl.models.sp_norm import sequence_parallel_block

        return sequence_parallel_block(spec, a.num_layers)
    return spec


def padded_vocab_size(vocab: int, tp: int, multiple: int = 128) -> int:
    """Megatron shards the vocab across TP: pad rows so every rank has an equal, aligned slice."""
    step = multiple * tp
    return ((vocab + step - 1) // step) * step
