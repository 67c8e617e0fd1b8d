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

from mcore_rl.config.model import LoadCheckConfig  # noqa: F401  (the schema of model.load_check; re-exported)
from mcore_rl.distributed import all_ranks_any, all_reduce

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


def settings_skip(cfg: LoadCheckConfig, dtype: str, from_hf: bool = True) -> str:
    """Why the settings alone rule the check out ('' if they do not). Needs no collective: every rank reads the
    same config, so a disabled check costs nothing, not even a process-group round trip."""
    mode = _mode(cfg.enabled)
    if mode == "false":
        return "model.load_check.enabled=false"
    if mode == "auto" and not from_hf:
        return "auto: the weights come from model.mcore_ckpt, which may legitimately differ from the HF folder"
    if dtype != "fp32":
        return f"model.dtype={dtype} (only fp32 logits are compared)"
    return ""


def memory_skip(num_params: int, avail: int) -> str:
    """`auto`'s memory rule: the HF reference model in fp32, plus headroom of one more copy, within half of `avail`."""
    need = 2 * 4 * num_params
    if need > avail // 2:
        return f"auto: {need / 1e9:.1f} GB for a reference copy exceeds half the free memory"
    return ""


def _agreed_decision(policy, cfg: LoadCheckConfig, from_hf: bool) -> str:
    """Collective only when `auto` must weigh memory: the parameter count is summed over the model's shards, and
    the check is skipped everywhere if any rank lacks the memory (free memory differs per rank, and ranks that
    disagree would leave the others waiting in the forward below)."""
    reason = settings_skip(cfg, policy.cfg.build.dtype, from_hf)
    if reason or _mode(cfg.enabled) != "auto":
        return reason
    import psutil

    n_local = sum(p.numel() for p in policy.model.parameters())
    total = int(all_reduce(torch.tensor([float(n_local)], dtype=torch.float64), "sum").item())
    reason = memory_skip(total, psutil.virtual_memory().available)
    if all_ranks_any(bool(reason)):
        return reason or "auto: another rank lacks the memory for a reference copy"
    return ""


def run_load_check(policy, model_dir: str | Path, cfg: LoadCheckConfig, from_hf: bool = True) -> LoadCheckResult:
    """Collective over all ranks unless the settings rule the check out. Returns the result on every rank (the max
    difference is all-reduced)."""
    from megatron.core import parallel_state as ps

    from mcore_rl.convert.megatron_model import forward_logits
    from mcore_rl.convert.verify import hf_logits, prompt_tokens

    reason = _agreed_decision(policy, cfg, from_hf)
    if reason:
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
    diff = all_reduce(diff, "max")
    return LoadCheckResult(True, "", float(diff.item()), tokens.numel())
