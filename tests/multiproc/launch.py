"""What the torchrun layout-equivalence tests share, both sides of the launch.

Worker side (runs under torchrun): the common command line, the policy every layout builds, and one Adam step from
ONE shared torch_dist checkpoint (random init is not PP-invariant, so layouts are compared from the same weights).
Test side (runs in pytest): write that checkpoint with a single-rank reference run, launch a layout, and compare
its log-probs, grad norm and post-step log-probs with the reference's.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from mcore_rl.policy.step import PolicyBatch
from tests.train_step import train_step

# ---- worker side -----------------------------------------------------------------------------------------------


def worker_parser(doc: str | None) -> argparse.ArgumentParser:
    """The flags every layout worker takes; a worker adds its own on top."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--hf", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--save-init", action="store_true")
    return ap


def layout_policy(hf: str, build, use_distributed_optimizer: bool = False):
    """The policy each layout builds: plain Adam (no weight decay, no clipping) so one step is comparable across
    layouts; beta2 0.999 as these tests have always used."""
    from mcore_rl.config.optim import OptimSettings
    from mcore_rl.policy.policy import Policy, PolicyConfig

    optim = OptimSettings(lr=1e-3, weight_decay=0.0, adam_beta2=0.999, clip_grad=0.0,
                          use_distributed_optimizer=use_distributed_optimizer)
    return Policy(hf, PolicyConfig(build=build, optim=optim, token_budget=48))


def fixed_batch(vocab: int) -> tuple[PolicyBatch, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    n, L = 8, 24
    tokens = torch.randint(0, vocab, (n, L), generator=g)
    lengths = torch.randint(12, L + 1, (n,), generator=g)
    mask = torch.zeros(n, L)
    for i, ln in enumerate(lengths.tolist()):
        mask[i, 6:ln] = 1.0
        tokens[i, ln:] = 0
    adv = torch.randn(n, generator=g)
    weight = mask * adv[:, None] / mask.sum()  # global token-mean with a per-sequence advantage
    return PolicyBatch(tokens, mask, {"weight": weight}), mask


def loss_fn(mb: PolicyBatch, logp: torch.Tensor, ent):
    return -(mb.extras["weight"] * logp).sum(), {}


@dataclass
class StepResult:
    batch: PolicyBatch
    mask: torch.Tensor
    before: torch.Tensor  # log-probs of the fixed batch before the step
    after: torch.Tensor  # ... and after one optimizer step
    stats: dict
    is_reporter: bool  # last PP stage, TP rank 0, DP rank 0: the rank that holds the full log-probs


def step_from_shared_checkpoint(policy, hf: str, ckpt: str, save_init: bool) -> StepResult:
    """Every layout starts from ONE torch_dist checkpoint (init is not PP-invariant), then takes one step.

    `save_init` (a single-rank run) writes that checkpoint from the HF weights instead of loading it."""
    from megatron.core import parallel_state as ps

    from mcore_rl.checkpoint_io import load_dist_checkpoint, save_dist_checkpoint

    if save_init:
        policy.load_hf(hf)
        save_dist_checkpoint(ckpt, policy.model, overwrite=True)
    else:
        load_dist_checkpoint(ckpt, policy.model)
        policy._sync_main_params()
    batch, mask = fixed_batch(policy.args.vocab_size)
    before = policy.logprobs(batch)
    # data parallel: each DP rank trains on its own rows; weights are global, so the summed loss is the same
    dp, dpr = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = [i for i in range(len(batch)) if i % dp == dpr]
    _, stats = train_step(policy, batch.select(rows), loss_fn)
    after = policy.logprobs(batch)
    is_reporter = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and dpr == 0
    return StepResult(batch, mask, before, after, stats, is_reporter)


def shutdown() -> None:
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


# ---- test side -------------------------------------------------------------------------------------------------


def reference_run(worker: Path, hf: Path, folder: Path) -> tuple[Path, dict]:
    """The single-rank run that writes the shared checkpoint under `folder`; returns (checkpoint, its report)."""
    from tests.conftest import run_torchrun

    ckpt, out = folder / "ckpt", folder / "reference.pt"
    run_torchrun(1, worker, "--hf", str(hf), "--ckpt", str(ckpt), "--out", str(out), "--save-init")
    return ckpt, torch.load(out, weights_only=True)


def layout_run(worker: Path, nproc: int, hf: Path, ckpt: Path, out: Path, *args: str) -> dict:
    """One layout from the shared checkpoint; returns its reporter rank's report."""
    from tests.conftest import run_torchrun

    run_torchrun(nproc, worker, "--hf", str(hf), "--ckpt", str(ckpt), "--out", str(out), *args)
    return torch.load(out, weights_only=True)


def assert_same_step(got: dict, ref: dict) -> None:
    """Same log-probs (1e-5) and grad norm (relative 1e-5) as the reference; post-step log-probs within 1e-3."""
    assert (got["before"] - ref["before"]).abs().max().item() < 1e-5
    assert abs(got["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"] < 1e-5
    assert (got["after"] - ref["after"]).abs().max().item() < 1e-3


def assert_step_moved(ref: dict) -> None:
    """The reference step really moved the weights, enough for the post-step comparison to mean something."""
    assert ref["grad_norm"] > 0.01
    assert (ref["after"] - ref["before"]).abs().max().item() > 1e-3
