"""`model.*`: where the policy's weights come from and how the network is built (dtype, kernels, FP8, MoE).

`Fp8Config` and `LoadCheckConfig` live here (re-exported by models/spec.py and convert/load_check.py) so the
schema Hydra checks and the object the builder reads are one class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mcore_rl.config.checks import ConfigError, one_of, positive
from mcore_rl.dtypes import BF16_MATMUL_MODES, SHORT

MODEL_SOURCES = ("smollm2", "hf", "tiny")
DTYPES = ("auto", *SHORT)
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")


@dataclass
class Fp8Config:
    """FP8 training (Transformer Engine only). Mapped 1:1 onto TransformerConfig's fp8_* fields."""

    enabled: bool = False
    format: str = "hybrid"  # hybrid (e4m3 fwd / e5m2 bwd) | e4m3
    recipe: str = "delayed"  # delayed | tensorwise | blockwise | mxfp8
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"  # max | most_recent
    margin: int = 0
    fp8_param: bool = False  # keep parameters in FP8 (saves memory, needs TE)


@dataclass
class LoadCheckConfig:
    """After loading the initial weights: Megatron vs transformers logits on a fixed prompt."""

    enabled: str = "auto"  # auto (models that fit twice in memory) | true | false
    tol: float = 1e-3  # max |logit difference| allowed (fp32)

    def __post_init__(self) -> None:
        self.enabled = str(self.enabled).lower()
        one_of("model.load_check.enabled", self.enabled, ("auto", "true", "false"))
        positive("model.load_check.tol", self.tol)


@dataclass
class MoeConfig:
    aux_loss_coeff: float = 0.0     # load-balancing loss weight; off for RL (docs/moe.md)

    def __post_init__(self) -> None:
        positive("model.moe.aux_loss_coeff", self.aux_loss_coeff, allow_zero=True)


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass
class LoraConfig:
    """LoRA adapters on the policy's Megatron linears (docs/lora.md); rank 0 = off, every weight trains.

    Why these names: they are Megatron's module names, the ones the TP sharding of an adapter follows
    (linear_qkv/linear_fc1 column-parallel, linear_proj/linear_fc2 row-parallel)."""

    rank: int = 0                   # r; 0 = no adapters (full-weight training)
    alpha: float = 16.0             # the update is alpha / r * B @ A
    dropout: float = 0.0            # dropout on the adapter's input (training forward only)
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))

    def __post_init__(self) -> None:
        positive("model.lora.rank", self.rank, allow_zero=True)
        positive("model.lora.alpha", self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.lora.dropout must be in [0, 1), got {self.dropout}")
        self.target_modules = list(self.target_modules)
        if not self.target_modules:
            raise ConfigError("model.lora.target_modules is empty; name at least one of " + ", ".join(LORA_TARGETS))
        for t in self.target_modules:
            one_of("model.lora.target_modules", t, LORA_TARGETS)

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass
class ModelConfig:
    source: str = "smollm2"         # smollm2 | hf (hf_path) | tiny (random init from `tiny`)
    hf_path: str | None = None      # an HF folder: start the policy from these weights through the family adapter
    mcore_ckpt: str | None = None   # or a Megatron dist-checkpoint from `mcore-rl-convert hf-to-mcore`
    dtype: str = "auto"             # auto (bf16 where this machine's bf16 matmul pays) | fp32 | bf16 | fp16
    transformer_impl: str = "auto"  # auto (TE when installed + CUDA) | local | transformer_engine
    recompute_activations: bool = False
    lm_head_fp32: bool = False      # bf16: LM head in fp32 (ScaleRL; smaller train/rollout mismatch)
    # bf16 on a CPU without bf16 matrix hardware: auto (fp32 GEMMs of the bf16 operands where torch's native bf16
    # matmul is slower, measured) | fp32 (always) | native (torch's bf16 kernels); compat/bf16_matmul.py
    bf16_matmul: str = "auto"
    # bf16/fp16 element-wise ops in the trainer: auto (compiled on CPU; on CUDA the layers' ops eager and the LM
    # head's log-prob kernels compiled: measured faster each) | true (torch.compile'd) | false (eager everywhere)
    compile: str = "auto"
    load_check: LoadCheckConfig = field(default_factory=LoadCheckConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    lora: LoraConfig = field(default_factory=LoraConfig)
    moe: MoeConfig | None = None    # MoE models only (hydra_conf/model/tiny_moe.yaml)
    tiny: dict[str, Any] | None = None  # source=tiny: HF config fields of the random model (+ model_type, seed)

    def __post_init__(self) -> None:
        one_of("model.source", self.source, MODEL_SOURCES)
        one_of("model.dtype", self.dtype, DTYPES)
        one_of("model.transformer_impl", self.transformer_impl, TRANSFORMER_IMPLS)
        one_of("model.bf16_matmul", self.bf16_matmul, BF16_MATMUL_MODES)
        self.compile = str(self.compile).lower()  # a bare `model.compile=false` arrives as the string "False"
        one_of("model.compile", self.compile, ("auto", "true", "false"))
        if self.source == "hf" and not self.hf_path:
            raise ConfigError("model.source=hf needs model.hf_path=/path/to/hf/folder")
        if self.lora.enabled and self.mcore_ckpt:
            raise ConfigError("model.lora.rank>0 with model.mcore_ckpt is not supported: start LoRA from the HF "
                              "folder (model.source=hf, model.hf_path)")
        if self.source == "tiny" and not self.tiny:
            raise ConfigError("model.source=tiny needs model.tiny (the random model's HF config fields)")
