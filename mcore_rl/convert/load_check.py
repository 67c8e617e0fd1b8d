"""Load-time check: after the policy's initial weights are loaded, its Megatron logits on a fixed prompt must equal
transformers' logits of the HF folder (the `verify` code, in the training job itself).

Why in the trainer: a wrong adapter mapping (a transposed projection, swapped experts) otherwise shows up only as a
run that learns badly. The check costs one extra forward and a second copy of the model in memory, so `auto` runs
it when two copies fit comfortably; it is always logged, and a difference above `tol` stops the run before training.
Only fp32 policies are compared: bf16/fp16 logits differ from fp32 ones by precision, not by mapping.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mcore_rl.config.model import LoadCheckConfig  # noqa: F401  (the schema of model.load_check; re-exported)

MODES = ("auto", "true", "false")


@dataclass
class LoadCheckResult:
    ran: bool
    reason: str
    max_abs_diff: float = float("nan")
    n_tokens: int = 0

    def line(self, tol: float) -> str:
        if not self.ran:
            return f"load check skipped: {self.reason}"
        verdict = "OK" if self.max_abs_diff <= tol else "FAIL"
        return (f"load check: Megatron vs transformers max_abs_logit_diff={self.max_abs_diff:.3e} tol={tol:g} "
                f"tokens={self.n_tokens} {verdict}")


def _mode(value) -> str:
    mode = str(value).lower()
    if mode not in MODES:
        raise ValueError(f"model.load_check.enabled={value!r}: expected auto, true or false")
    return mode


def should_run(cfg: LoadCheckConfig, num_params: int, dtype: str, from_hf: bool = True) -> tuple[bool, str]:
    mode = _mode(cfg.enabled)
    if mode == "false":
        return False, "model.load_check.enabled=false"
    if mode == "auto" and not from_hf:
        return False, "auto: the weights come from model.mcore_ckpt, which may legitimately differ from the HF folder"
    if dtype != "fp32":
        return False, f"model.dtype={dtype} (only fp32 logits are compared)"
    if mode == "auto":
        import psutil

        need = 2 * 4 * num_params  # the HF reference model in fp32, plus headroom of one more copy
        avail = psutil.virtual_memory().available
        if need > avail // 2:
            return False, f"auto: {need / 1e9:.1f} GB for a reference copy exceeds half the free memory"
    return True, ""


def run_load_check(policy, model_dir: str | Path, cfg: LoadCheckConfig, from_hf: bool = True) -> LoadCheckResult:
    """Collective over all ranks. Returns the result on every rank (the max difference is all-reduced)."""
    from megatron.core import parallel_state as ps

    from mcore_rl.convert.megatron_model import forward_logits
    from mcore_rl.convert.verify import hf_logits, prompt_tokens

    n_local = sum(p.numel() for p in policy.model.parameters())
    total = torch.tensor([float(n_local)])
    if dist.is_initialized():
        dist.all_reduce(total)
    ok, reason = should_run(cfg, int(total.item()), policy.cfg.build.dtype, from_hf)
    if not ok:
        return LoadCheckResult(False, reason)
    tokens, _ = prompt_tokens(Path(model_dir), policy.args.vocab_size)
    tokens = tokens[:, :64]
    was_training = policy.model.training
    got = forward_logits(policy.model, tokens, policy.args.vocab_size)
    if was_training:
        policy.model.train()
    diff = torch.zeros(1)
    reporter = got is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    if reporter:
        ref = hf_logits(Path(model_dir), tokens)
        diff[0] = (got - ref).abs().max() if got.shape == ref.shape else float("inf")
        del ref
        gc.collect()
    if dist.is_initialized():
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return LoadCheckResult(True, "", float(diff.item()), tokens.numel())
