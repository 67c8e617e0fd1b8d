"""LoRA adapters on Megatron's tensor-parallel linears: y = W x + alpha/r * B (A x), with W frozen.

Sharding follows the base weight so no adapter tensor is ever gathered in the forward:
- column-parallel (linear_qkv, linear_fc1; W split on its output rows): B [out/tp, r] is split like W, A [r, in]
  is replicated. A's gradient sums over every rank's output rows, so the rank-r activation A x passes through
  Megatron's `copy_to_tensor_model_parallel_region` (identity forward, TP all-reduce backward): every rank then
  holds A's full gradient, which is why A is marked TP-replicated (counted once in the grad norm).
- row-parallel (linear_proj, linear_fc2; W split on its input columns): A [r, in/tp] is split like W, B [out, r]
  is replicated. A x is a partial sum per rank, all-reduced (`reduce_from_tensor_model_parallel_region`) before B.
Under sequence parallelism only rank-r activations cross ranks (gather / reduce-scatter over the sequence), and the
replicated factor (column A, row B) is marked `sequence_parallel`; `_rank_r_input` derives why.
The fused [gate; up] fc1 rows of each TP rank are B's rows too, so a rank's merged shard is W_r + s * B_r @ A_r
for both kinds: weight sync merges shard by shard and gathers as it does for plain weights.

MoE experts (SequentialMLP, `...mlp.experts.local_experts.<i>.linear_fc1/fc2`): one adapter per expert, built
like the dense ones but over the expert's own linear: its `tp_group` (expert TP) shards it, and `allreduce` is copied
from its weight, so under EP>1 the adapter is an expert-parallel parameter (DDP reduces its grad over the
expert-data-parallel group, the optimizer puts it in the expert param group). Expert TP > 1 is refused: there the
token dispatcher, not the linear, does the TP communication (`explicit_expert_comm`), so the regions above would
count the adapter's dx and A's gradient once per expert-TP rank. GroupedMLP / TEGroupedMLP (moe_grouped_gemm) are refused too: their
experts are one stacked weight, not a linear per expert.

The adapters live on the linear itself (`lora_A`, `lora_B`) and run in a forward hook: parameter names of the base
weights do not change, so HF loading, dist checkpoints and the weight stream keep their name mapping.
"""

from __future__ import annotations

import contextlib
import logging
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mcore_rl.config.checks import ConfigError
from mcore_rl.config.model import LoraConfig

ADAPTER_SUFFIXES = (".lora_A", ".lora_B")
COLUMN = ("linear_qkv", "linear_fc1")  # Megatron's column-parallel linears among the targets


@dataclass
class LoraState:
    """Per-linear settings the forward hook reads (`enabled` is flipped for the reference log-probs)."""

    kind: str  # column | row
    scale: float
    dropout: float
    sequence_parallel: bool = False  # the linear's input (column) / output (row) is sequence-sharded
    enabled: bool = True


def is_adapter_param(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def _target_linears(gpt, targets: list[str]) -> Iterator[tuple[str, torch.nn.Module]]:
    for name, module in gpt.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in targets and hasattr(module, "weight"):
            yield name, module


def _init_a(name: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    """A's full-size init (PEFT's kaiming-uniform, bound 1/sqrt(in)) from a stream keyed by the global name:
    every TP/PP layout draws the same full A and slices its own part."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=g)


def _refuse_unsupported(gpt, cfg: LoraConfig) -> None:
    experts = {"linear_fc1", "linear_fc2"} & set(cfg.target_modules)
    if gpt.config.num_moe_experts and experts and getattr(gpt.config, "moe_grouped_gemm", False):
        raise ConfigError(
            f"model.lora.target_modules: {','.join(sorted(experts))} on grouped-GEMM experts is not supported; "
            "LoRA on experts needs SequentialMLP (moe_grouped_gemm=false)"
        )


def shard_group(linear):
    """The group that shards this linear's weight, and so its adapter: the dense TP group, or expert TP for an
    expert's linear (Megatron's parallel linears carry it as `tp_group`)."""
    from megatron.core import parallel_state as ps

    g = getattr(linear, "tp_group", None)
    return ps.get_tensor_model_parallel_group() if g is None else g


def _add_adapter(gpt, name: str, linear, cfg: LoraConfig, seed: int) -> None:
    from mcore_rl.policy.param_names import global_name

    if type(linear).__name__.startswith("TELayerNorm"):
        raise ConfigError(
            "model.lora needs model.transformer_impl=local: Transformer Engine fuses the layer "
            f"norm into {name}, so the adapter would see the un-normalised input"
        )
    group = shard_group(linear)
    tp_rank, tp_size = group.rank(), group.size()
    if ".experts." in name and tp_size > 1:
        raise ConfigError(
            f"model.lora.target_modules: {name} is split over expert tensor parallelism ({tp_size}), which "
            "LoRA does not support (the token dispatcher does that TP communication); use parallel.ep instead"
        )
    kind = "column" if name.rsplit(".", 1)[-1] in COLUMN else "row"
    w = linear.weight
    out_l, in_l = w.shape
    full_in = in_l * (tp_size if kind == "row" else 1)
    a_full = _init_a(global_name(gpt, name + ".lora_A"), (cfg.rank, full_in), seed)
    a = a_full if kind == "column" else torch.chunk(a_full, tp_size, dim=1)[tp_rank]
    linear.lora_A = torch.nn.Parameter(a.to(device=w.device, dtype=w.dtype).contiguous())
    linear.lora_B = torch.nn.Parameter(torch.zeros(out_l, cfg.rank, device=w.device, dtype=w.dtype))
    split = linear.lora_B if kind == "column" else linear.lora_A
    dup = linear.lora_A if kind == "column" else linear.lora_B
    split.tensor_model_parallel, split.partition_dim, split.partition_stride = True, 0 if kind == "column" \
        else 1, 1  # fmt: skip
    dup.tensor_model_parallel, dup.partition_dim, dup.partition_stride = False, -1, 1
    # `allreduce` is False on EP>1 experts: DDP reduces over expert-DP, the optimizer puts them in its expert group
    if hasattr(w, "allreduce"):
        linear.lora_A.allreduce = linear.lora_B.allreduce = w.allreduce
    sp = bool(getattr(linear, "sequence_parallel", False)) and tp_size > 1
    # under SP the replicated factor's grad covers this rank's tokens only: finalize_model_grads sums it over TP
    if sp:
        dup.sequence_parallel = True
    linear._lora = LoraState(kind, cfg.alpha / cfg.rank, cfg.dropout, sp)
    linear.register_forward_hook(_lora_hook, with_kwargs=True)
    swiglu = name.endswith("linear_fc1") and bool(gpt.config.gated_linear_unit)
    linear.sharded_state_dict = _sharded_state_dict_fn(linear, swiglu)


def attach_adapters(gpt, cfg: LoraConfig, seed: int = 0) -> int:
    """Add rank-`cfg.rank` adapters to the target linears of `gpt` (unwrapped, before DDP) and freeze every other
    parameter. Returns the number of adapted linears. B starts at zero: the policy starts as the base model."""
    _refuse_unsupported(gpt, cfg)
    for p in gpt.parameters():
        p.requires_grad_(False)
    n = 0
    for name, linear in list(_target_linears(gpt, cfg.target_modules)):
        _add_adapter(gpt, name, linear, cfg, seed)
        n += 1
    if n == 0:
        raise ConfigError(f"model.lora.target_modules={cfg.target_modules}: no such linear in this model")
    trainable, total = trainable_parameters(gpt)
    logging.getLogger("mcore_rl").info(
        "LoRA rank %d on %d linears (%s): %s of %s parameters train (%.2f%%) on this rank",
        cfg.rank, n, ",".join(cfg.target_modules), f"{trainable:,}", f"{total:,}", 100.0 * trainable / total,
    )  # fmt: skip
    return n


def _lora_hook(module, args, kwargs, output):
    st: LoraState = module._lora
    if not st.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    if st.dropout and module.training:
        x = F.dropout(x, st.dropout, training=True)
    h = _rank_r_input(module, st, torch.matmul(x, module.lora_A.t()))
    delta = torch.matmul(h, module.lora_B.t()) * st.scale
    out, bias = output
    return out + delta.to(out.dtype), bias


def _rank_r_input(module, st: LoraState, h: torch.Tensor) -> torch.Tensor:
    """The rank-r activation in the layout B's product must have (the linear's output layout); see the module doc.

    Without sequence parallelism: column -> copy region (A's grad all-reduced in backward); row -> all-reduce.
    With it, only rank-r tensors cross ranks (never the hidden-size input or output):
    - column: x is this rank's sequence shard, the output covers the whole sequence. h_s = A x_s is gathered over
      the sequence (all-gather forward, reduce-scatter backward): each rank's dh = B_r^T dy_r is a partial sum over
      the TP ranks' output rows, and the reduce-scatter both sums it and hands each rank its own shard, so dx is
      right (an all-gather with a plain-split backward would drop the other ranks' terms). A's grad dh_s^T x_s then
      covers this rank's tokens only: A is marked `sequence_parallel` so finalize_model_grads sums it over TP,
      as Megatron does for the LayerNorm weights under sequence parallelism.
    - row: A_r x_r is a partial sum over the full sequence, the output is this rank's sequence shard. A
      reduce-scatter sums it and keeps the shard (its backward all-gathers dh, so A_r's grad covers every token);
      B's grad dy_s^T h_s covers this rank's tokens only, so B is marked `sequence_parallel` too. The alternative,
      all-reduce then split the output, needs no marking but all-gathers the hidden-size dy in backward and runs
      B on every token on every rank: the reduce-scatter moves r numbers per token instead of hidden-size ones.
    """
    from megatron.core import tensor_parallel as tpl

    g = shard_group(module)
    if st.kind == "column":
        if st.sequence_parallel:
            return tpl.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=g)
        return tpl.copy_to_tensor_model_parallel_region(h, group=g)
    if st.sequence_parallel:
        return tpl.reduce_scatter_to_sequence_parallel_region(h, group=g)
    return tpl.reduce_from_tensor_model_parallel_region(h, group=g)


def _sharded_state_dict_fn(linear, swiglu: bool):
    """The linear's dist-checkpoint entries with the adapters sharded like the weight (Megatron's own method would
    mark them replicated); fc1's B gets the [gate; up] factory Megatron's MLP applies to fc1's weight."""

    def sharded_state_dict(prefix: str = "", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axes = (
            {"weight": 0, "bias": 0, "lora_B": 0}
            if linear._lora.kind == "column"
            else {"weight": 1, "lora_A": 1}
        )
        sd = make_sharded_tensors_for_checkpoint(
            linear.state_dict(prefix="", keep_vars=True),
            prefix,
            axes,
            sharded_offsets,
            tp_group=linear.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )
        if swiglu:
            key = f"{prefix}lora_B"
            sd[key] = apply_swiglu_sharded_factory(
                sd[key], sharded_offsets, (metadata or {}).get("singleton_local_shards", False)
            )
        return sd

    return sharded_state_dict


# ---------------------------------------------------------------- using adapters
def adapted_linears(gpt) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name, linear) of every adapted linear; names are relative to `gpt` (pass the unwrapped GPTModel)."""
    for name, m in gpt.named_modules():
        if hasattr(m, "_lora"):
            yield name, m


def has_adapters(model) -> bool:
    return any(hasattr(m, "_lora") for m in model.modules())


@contextlib.contextmanager
def adapters_disabled(model):
    """The base model: every adapter skipped inside the block (the reference policy, no second model)."""
    linears = [m for m in model.modules() if hasattr(m, "_lora")]
    before = [m._lora.enabled for m in linears]
    for m in linears:
        m._lora.enabled = False
    try:
        yield model
    finally:
        for m, e in zip(linears, before):
            m._lora.enabled = e


def merged_shard(linear) -> torch.Tensor:
    """This rank's shard of W + alpha/r * B @ A (the same shape as its weight shard), for weight sync."""
    st: LoraState = linear._lora
    w = linear.weight.data
    if not st.enabled:
        return w
    delta = torch.matmul(linear.lora_B.data.float(), linear.lora_A.data.float()) * st.scale
    return (w.float() + delta).to(w.dtype)


class BasePolicyView:
    """The reference policy of a LoRA run: the trained policy's own model with its adapters switched off."""

    def __init__(self, policy) -> None:
        self.policy = policy

    def logprobs(self, batch, temperature: float = 1.0):
        with adapters_disabled(self.policy.model):
            return self.policy.logprobs(batch, temperature)


def adapter_entries(sharded: dict) -> dict:
    """The adapter entries of a model's sharded state dict (a LoRA checkpoint holds nothing else)."""
    return {k: v for k, v in sharded.items() if is_adapter_param(k)}


def trainable_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameter counts on this rank."""
    ps = list(model.parameters())
    return sum(p.numel() for p in ps if p.requires_grad), sum(p.numel() for p in ps)
