"""The trainable policy: a (TP/PP/DP-sharded) Megatron GPTModel + optimizer, with log-prob and train-step APIs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from mcore_rl.config.model import LoraConfig
from mcore_rl.config.optim import OptimSettings
from mcore_rl.distributed import all_reduce
from mcore_rl.models.base import ModelArgs, family_for, read_hf_config
from mcore_rl.models.hf_io import HFReader
from mcore_rl.models.spec import BuildConfig
from mcore_rl.policy.build import build_gpt_model, build_optimizer, unwrap
from mcore_rl.policy.hf_weights import iter_hf_tensors, load_hf_into_model
from mcore_rl.policy.precision import resolve_dtype
from mcore_rl.policy.step import LossFn, PolicyBatch, run_forward_backward, split_micro_batches


@dataclass
class PolicyConfig:
    build: BuildConfig = field(default_factory=BuildConfig)
    optim: OptimSettings = field(default_factory=OptimSettings)  # the `optim.*` group's schema dataclass
    decay_steps: int = 1000  # LR schedule length; the trainer passes trainer.steps
    token_budget: int = 4096  # tokens per micro-batch (rows * padded length)
    # micro-batch rows packed without pad tokens where the model allows (packing.py): exact, less memory; the
    # trainer sets it from trainer.pack_rows (trainer/setup.resolve_pack_rows: on CUDA with flash varlen attention)
    packed: bool = False
    seed: int = 0  # bf16 stochastic rounding's noise stream (with the optimizer step); LoRA A's init
    lora: LoraConfig = field(default_factory=LoraConfig)  # `model.lora`; rank 0 = full-weight training


class Policy:
    def __init__(self, hf_config: dict | str | Path, cfg: PolicyConfig, trainable: bool = True):
        hf = read_hf_config(hf_config)
        self.family = family_for(hf)
        self.args: ModelArgs = self.family.args(hf)
        self.cfg = cfg
        cfg.build.dtype = resolve_dtype(cfg.build.dtype)  # `auto` -> fp32 | bf16, measured once, logged
        self.model = build_gpt_model(  # frozen (trainable=False): no DDP gradient buffers, no optimizer
            self.args, cfg.build, use_distributed_optimizer=cfg.optim.use_distributed_optimizer, trainable=trainable,
            lora=cfg.lora, seed=cfg.seed,
        )
        self.optimizer = self.scheduler = None
        self.base_path: Path | None = None
        self.router_load = None
        if self.args.moe is not None:
            from mcore_rl.policy.moe_metrics import RouterLoad

            self.router_load = RouterLoad(self.model, self.args.moe.num_experts)
        if trainable:
            self.optimizer, self.scheduler = build_optimizer(self.model, cfg.build, cfg.optim, cfg.decay_steps,
                                                               seed=cfg.seed)

    # ---- weights --------------------------------------------------------------------------------------------
    @property
    def gpt(self):
        return unwrap(self.model)

    def load_hf(self, folder: str | Path) -> int:
        self.base_path = Path(folder)  # a LoRA checkpoint names its base by this path (+ hash)
        with HFReader(folder) as reader:
            n = load_hf_into_model(self.model, self.family, self.args, reader)
        self._sync_main_params()
        return n

    def _sync_main_params(self) -> None:
        """After writing model params directly, refresh the optimizer's fp32 master copies (bf16/fp16 runs)."""
        if self.optimizer is not None and hasattr(self.optimizer, "reload_model_params"):
            self.optimizer.reload_model_params()

    def hf_tensors(self, dst: int = 0):
        """Full HF-named tensors on global rank `dst` (every rank must iterate)."""
        return iter_hf_tensors(self.model, self.family, self.args, dst)

    @staticmethod
    def is_last_stage() -> bool:
        from megatron.core import parallel_state as ps

        return ps.is_pipeline_last_stage()

    # ---- compute --------------------------------------------------------------------------------------------
    def micro_batches(self, batch: PolicyBatch) -> list[PolicyBatch]:
        """Token-budget micro-batches, padded to the same count on every DP rank.

        Losses that all-reduce inside the micro-batch (P3O's ESS) need every DP rank to run the same number of
        micro-batches; padding micro-batches have an all-zero loss mask and weights, so they contribute nothing.
        """
        mbs = split_micro_batches(batch, self.cfg.token_budget)
        from megatron.core import parallel_state as ps

        if ps.get_data_parallel_world_size() > 1:
            n = all_reduce(torch.tensor([len(mbs)]), "max", ps.get_data_parallel_group())
            while len(mbs) < int(n.item()):
                pad = mbs[-1].select([0])
                mbs.append(PolicyBatch(pad.tokens, torch.zeros_like(pad.loss_mask),
                                       {k: torch.zeros_like(v) for k, v in pad.extras.items()}))
        return mbs

    @torch.no_grad()
    def logprobs(self, batch: PolicyBatch, temperature: float = 1.0) -> torch.Tensor | None:
        """Per-token log-probs [N, L] (aligned with tokens; 0 at position 0). None off the last PP stage."""
        self.model.eval()
        mbs = self.micro_batches(batch)
        outs = run_forward_backward(self.model, mbs, self.args.vocab_size, None, temperature, packed=self.cfg.packed)
        if not self.is_last_stage():
            return None
        full = torch.zeros(batch.tokens.shape, dtype=torch.float32)
        for mb, out in zip(mbs, outs):
            if mb.index is not None:  # not a DP padding micro-batch
                full[mb.index, :mb.tokens.shape[1]] = out["logp"].float().cpu()
        return full

    def forward_backward(self, batch: PolicyBatch, loss_fn: LossFn, temperature: float = 1.0,
                         with_entropy: bool = False) -> list[dict]:
        """Accumulate gradients of sum(micro-batch losses) (no averaging: losses are pre-normalised)."""
        self.model.train()
        return run_forward_backward(self.model, self.micro_batches(batch), self.args.vocab_size, loss_fn,
                                    temperature, with_entropy, packed=self.cfg.packed)

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self) -> dict[str, float]:
        ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        out = {"grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
               "update_ok": float(bool(ok)), "lr": self.optimizer.param_groups[0]["lr"]}
        if self.router_load is not None:  # MoE: token share per expert since the last step (collective)
            out.update(self.router_load.read())
        return out

