"""What a run is built from, checked before any model exists: the model folder, its fit to the parallel layout,
the network's build settings (with `model.dtype` resolved once), the preemption flag."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mcore_rl.config import ConfigError, MainConfig
from mcore_rl.distributed import all_ranks_any
from mcore_rl.models.base import family_for, read_hf_config
from mcore_rl.models.moe_spec import validate_moe_parallel
from mcore_rl.models.source import resolve_model_dir
from mcore_rl.models.spec import BuildConfig, resolve_impl, validate_parallel
from mcore_rl.policy.policy import PolicyConfig

# re-exported here: ConfigError (home: mcore_rl.config), resolve_model_dir (home: mcore_rl.models.source)
__all__ = ["ConfigError", "resolve_model_dir"]
log = logging.getLogger(__name__)
GPU_TOKEN_BUDGET = 8192  # below this many tokens per micro-batch a CUDA run is told so at start


def warn_small_gpu_budget(token_budget: int, cuda: bool | None = None) -> str | None:
    """The default trainer.token_budget (512) sizes the CPU main job's micro-batches. On a GPU a micro-batch's
    host-side cost (Megatron's Python, one launch per kernel) does not shrink with its tokens: at 8,192 tokens an
    H100's 0.5B bf16 step already waited on the host, and an H200 gained up to 16,384 tokens (29% -> 33% of the
    matmul roofline all eager; 43-47% at 16,384 with the LM head compiled; docs/gpu_checks.md). Memory per token
    depends on the model and the parallel layout, so the budget is not raised behind the user's back: one warning
    says what to set. Returns it (None: nothing to say)."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if not cuda or token_budget >= GPU_TOKEN_BUDGET:
        return None
    msg = (f"trainer.token_budget={token_budget} on CUDA: micro-batches that small leave the GPU waiting on the host; "
           f"set trainer.token_budget={GPU_TOKEN_BUDGET}-16384 as memory allows (a 0.5B bf16 step on an H200: 43-47% "
           f"of the matmul roofline at 16,384 tokens, peak 31 GB)")
    log.warning(msg)
    return msg


def build_config(cfg: MainConfig, dtype: str | None = None) -> BuildConfig:
    """The network's build settings; `dtype` is the run's resolved model.dtype (None: as configured)."""
    m, par = cfg.model, cfg.parallel
    return BuildConfig(dtype=dtype or m.dtype, transformer_impl=m.transformer_impl, tp=par.tp, pp=par.pp,
                       sequence_parallel=par.sequence_parallel, fp8=m.fp8,
                       recompute_activations=m.recompute_activations, ep=par.ep,
                       moe_aux_loss_coeff=float(m.moe.aux_loss_coeff) if m.moe is not None else 0.0,
                       lm_head_fp32=m.lm_head_fp32, compile=resolve_compile(m.compile),
                       compile_head=resolve_head_compile(m.compile))


def resolve_compile(setting: str, cuda: bool | None = None) -> bool:
    """model.compile=auto: the compiled element-wise ops on CPU, eager on CUDA (the LM head's kernels: see
    `resolve_head_compile`). On CPU they fuse passes that eager PyTorch runs one at a time (docs/performance.md);
    on an H100 the same bf16 step ran 0.68-0.92x the eager speed (dynamo's per-call guards on the host, while the
    GPU waited; docs/gpu_checks.md)."""
    if setting != "auto":
        return setting == "true"
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()  # build_gpt_model puts the model on CUDA whenever there is one
    return not cuda


def resolve_head_compile(setting: str) -> bool:
    """The LM head's per-chunk log-prob kernels compile unless model.compile=false, on CUDA as on CPU. There they
    are a handful of calls per step, each over a GiB of fp32 logits, so dynamo's per-call host cost is nothing
    next to the passes eager PyTorch makes over each chunk (max, shift, exp, sum, gather; backward as many again):
    on an H200, compiling them cut a 0.5B bf16 step's GPU time from 237 to 176 ms, 1.22x the tokens/s
    (docs/gpu_checks.md)."""
    return setting != "false"


def resolve_pack_rows(setting: str, dtype: str, cuda: bool | None = None) -> tuple[bool, str]:
    """trainer.pack_rows as the run uses it, and why. auto: packed on CUDA in bf16/fp16 where PyTorch has flash
    attention's varlen kernel (one call per layer for the whole pack, models/varlen.py): on an H200 a 0.5B bf16
    step on ragged rows ran 1.15x the padded speed with 21% less peak memory (docs/gpu_checks.md). Padded
    elsewhere: on CPU the per-sequence attention made packing 0.76-0.87x (docs/performance.md)."""
    if setting != "auto":
        return setting == "true", f"trainer.pack_rows={setting}"
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    from mcore_rl.models import varlen

    if not cuda:
        return False, "trainer.pack_rows=auto: padded on CPU"
    if dtype not in ("bf16", "fp16"):
        return False, f"trainer.pack_rows=auto: padded in {dtype} (flash attention's varlen kernel: bf16/fp16)"
    if varlen.api() is None:
        return False, "trainer.pack_rows=auto: padded (this PyTorch has no torch.nn.attention.varlen)"
    return True, "trainer.pack_rows=auto: CUDA, flash varlen attention"


def policy_config(cfg: MainConfig, dtype: str | None = None) -> PolicyConfig:
    packed, _ = resolve_pack_rows(cfg.trainer.pack_rows, dtype or cfg.model.dtype)
    return PolicyConfig(build=build_config(cfg, dtype), optim=cfg.optim, decay_steps=max(1, cfg.trainer.steps),
                        token_budget=cfg.trainer.token_budget, packed=packed, seed=int(cfg.seed),
                        lora=cfg.model.lora)


def check_model_against_parallel(cfg: MainConfig, model_dir: Path) -> None:
    hf = read_hf_config(model_dir)
    try:
        args = family_for(hf).args(hf)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        validate_parallel(args, cfg.parallel.tp, cfg.parallel.pp, world)
        validate_moe_parallel(args, cfg.parallel.tp, cfg.parallel.ep, world, cfg.parallel.pp,
                              sequence_parallel=bool(cfg.parallel.sequence_parallel))
        resolve_impl(build_config(cfg))
    except (ValueError, RuntimeError) as e:
        raise ConfigError(str(e)) from None


@dataclass
class StopFlag:
    """Set by SIGUSR1/SIGTERM (Slurm preemption); the loop checkpoints and exits at the next round boundary."""

    requested: bool = False
    signals: list[int] = field(default_factory=list)

    def install(self) -> None:
        import signal

        def handler(signum: int, frame: Any) -> None:
            self.requested = True
            self.signals.append(signum)
            # The flag is set; train.sbatch re-sends USR1 until we exit. Ignore the repeats: Python restores
            # SIG_DFL for handled signals at interpreter shutdown, and a repeat then would kill a clean exit.
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)

        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, handler)

    def agreed(self) -> bool:
        """All ranks stop together if any rank was signalled."""
        return all_ranks_any(self.requested)
