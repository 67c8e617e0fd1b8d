"""Mixture-of-Experts pieces of the Megatron build: TransformerConfig fields, layer spec, parallel checks.

Kept apart from spec.py (dense attention/MLP settings) so MoE selection is one call site: `build.py` merges
`moe_config_kwargs` into the TransformerConfig and asks `moe_layer_spec` for the layer when the model has experts.

Why the load-balancing loss is off by default: peers' RL recipes fine-tune an already balanced pretrained router
(slime and verl ship Qwen3-MoE RL scripts with the aux loss at 0 or a tiny weight): the policy-gradient loss is what
should move the weights, an extra router loss changes the policy being optimised away from the one that generated
the samples (biasing importance ratios), and on small RL batches its gradient is noisy. Set
`model.moe.aux_loss_coeff` > 0 to turn it on (Megatron's `aux_loss` balancing).
"""

from __future__ import annotations

from typing import Any

from mcore_rl.models.base import ModelArgs


def validate_moe_parallel(a: ModelArgs, tp: int, ep: int, world_size: int | None = None, pp: int = 1,
                          sequence_parallel: bool | None = None) -> None:
    """`sequence_parallel` is given for training builds: Megatron trains MoE with TP only under sequence
    parallelism (the local spec runs it with `sp_norm.TorchNorm`). Conversion and verification are forward-only and
    run at any TP."""
    if ep < 1:
        raise ValueError(f"parallel.ep={ep} must be >= 1")
    if a.moe is None:
        if ep > 1:
            raise ValueError(f"parallel.ep={ep} needs a Mixture-of-Experts model ({a.architecture} is dense)")
        return
    if a.moe.num_experts % ep:
        raise ValueError(f"parallel.ep={ep} does not divide num_experts={a.moe.num_experts}")
    if sequence_parallel is not None and tp > 1 and not sequence_parallel:
        raise ValueError(f"parallel.tp={tp} with a Mixture-of-Experts model trains only with "
                         "parallel.sequence_parallel=true (Megatron)")
    if world_size is not None and (world_size // pp) % ep:
        raise ValueError(f"parallel.ep={ep} does not divide the {world_size // pp} ranks of a pipeline stage")


def moe_config_kwargs(a: ModelArgs, ep: int, aux_loss_coeff: float) -> dict[str, Any]:
    """TransformerConfig fields for a routed MoE MLP matching HF's Qwen3-MoE block (empty for dense models)."""
    if a.moe is None:
        return {}
    if aux_loss_coeff < 0:
        raise ValueError(f"model.moe.aux_loss_coeff={aux_loss_coeff} must be >= 0")
    m = a.moe
    return dict(
        num_moe_experts=m.num_experts,
        moe_ffn_hidden_size=m.ffn_hidden_size,
        moe_router_topk=m.topk,
        moe_router_score_function="softmax",
        # top-k over logits then softmax == HF's softmax -> top-k -> renormalise (norm_topk_prob=True)
        moe_router_pre_softmax=not m.norm_topk_prob,
        moe_router_dtype="fp32",
        moe_token_dispatcher_type="alltoall",  # gloo has all_to_all_single; the same dispatcher runs on NCCL
        moe_grouped_gemm=False,  # SequentialMLP: per-expert linears, the layout the adapter maps
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=aux_loss_coeff,
        moe_shared_expert_intermediate_size=m.shared_expert_size or None,
        moe_shared_expert_gate=m.shared_expert_gate,
        # 1 = MoE layer, 0 = dense MLP (moe_layer_spec builds the matching per-layer specs)
        moe_layer_freq=[int(m.is_moe_layer(i)) for i in range(a.num_layers)] if m.dense_layers else 1,
        expert_model_parallel_size=ep,
    )


def _layer(a: ModelArgs, impl: str, num_experts: int | None):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if impl == "transformer_engine":
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=a.qk_norm)
    return specs.get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                          qk_layernorm=a.qk_norm, normalization="RMSNorm")


def moe_layer_spec(a: ModelArgs, impl: str, pp_rank: int | None = None, pp: int | None = None,
                   sequence_parallel: bool = False):
    """Layer spec with a routed MoE MLP (SequentialMLP experts, so checkpoints name experts one by one).

    With dense layers among the MoE layers (HF `mlp_only_layers`, `decoder_sparse_step`), a block spec listing this
    pipeline stage's layers, each MoE or dense (layers split evenly over stages: validate_parallel).
    `sequence_parallel` (TP > 1 training) on the local spec: every norm, the final one too, is `sp_norm.TorchNorm`,
    which runs on a sequence shard (Megatron's WrappedTorchNorm refuses it)."""
    from mcore_rl.compat import moe as moe_compat

    moe_compat.apply()
    local_sp = sequence_parallel and impl != "transformer_engine"
    if not a.moe.dense_layers:
        layer = _layer(a, impl, a.moe.num_experts)
        if local_sp:
            from mcore_rl.models.sp_norm import sequence_parallel_block

            return sequence_parallel_block(layer, a.num_layers)
        return layer
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

    pp_rank = ps.get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank
    pp = ps.get_pipeline_model_parallel_world_size() if pp is None else pp
    per_stage = a.num_layers // pp
    moe, dense = _layer(a, impl, a.moe.num_experts), _layer(a, impl, None)
    final_norm = LayerNormImpl
    if local_sp:
        from mcore_rl.models.sp_norm import TorchNorm, swap_norms

        swap_norms(moe)
        swap_norms(dense)
        final_norm = TorchNorm
    layers = range(pp_rank * per_stage, (pp_rank + 1) * per_stage)
    return TransformerBlockSubmodules(layer_specs=[moe if a.moe.is_moe_layer(i) else dense for i in layers],
                                      layer_norm=final_norm)
