"""Stochastic rounding of the fp32 master weights into the bf16 model weights after each optimizer step.

Why: in bf16 mixed precision the optimizer updates fp32 master weights and Megatron copies them into the bf16
model with round-to-nearest. The masters start as copies of the bf16 weights, i.e. exactly on the bf16 grid, so a
weight's bf16 value only moves once its accumulated update exceeds half a bf16 ulp (2^-9 relative). RL
fine-tuning runs at small learning rates for few steps: SmolLM2-135M's median |w| is 0.11 (half-ulp 2.4e-4), so at
lr 2e-5 even a weight pushed the same way by ten Adam steps (<= 2e-4) keeps its initial bf16 value for ~70% of the
weights -- the policy that generates and is scored lags the optimizer's. Stochastic rounding (round up with
probability equal to the distance from the lower neighbour) makes the bf16 weight an unbiased estimate of the
master at every step: no dead zone, at the cost of <= 1 ulp of zero-mean noise per weight (the same size as the
rounding bf16 already applies).

Only the copy changes: the masters keep their exact fp32 values (restored after Megatron's copy), so optimizer
state and checkpoints are those of a round-to-nearest run. The noise comes from a generator seeded by
(seed, optimizer step), identical on every rank: data-parallel replicas stay bitwise equal (the distributed
optimizer rounds each rank's own shard before its all-gather), and a resumed run draws the same noise as an
uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

_LOW16 = 1 << 16


def stochastic_round_to_bf16_(x: Tensor, generator: torch.Generator) -> Tensor:
    """Round fp32 `x` in place onto the bf16 grid, stochastically; returns x (exactly representable in bf16).

    Adds uniform noise to the 16 bits bf16 drops, then truncates them: the value rounds away from zero with
    probability (dropped bits) / 2^16. On the IEEE bit pattern this works for both signs (sign-magnitude), and a
    carry into the exponent is the next bf16 value up; +-inf stay inf (their low bits are zero and get cleared).
    """
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic rounding needs fp32 master weights, got {x.dtype}")
    bits = x.view(torch.int32)
    noise = torch.randint(0, _LOW16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    bits.add_(noise).bitwise_and_(-_LOW16)
    return x


def _bf16_masters(opt) -> list[Tensor]:
    """The fp32 tensors Megatron copies into bf16 model params (whole params, or this rank's shards)."""
    groups = getattr(opt, "shard_fp32_from_float16_groups", None)  # DistributedOptimizer
    if groups is None:
        groups = getattr(opt, "fp32_from_float16_groups", None)  # Float16OptimizerWithFloat16Params
    return [t for group in groups or [] for t in group if t is not None and t.numel()]


def enable_bf16_stochastic_rounding(optimizer, seed: int, step: Callable[[], int]) -> int:
    """Make every bf16 optimizer under `optimizer` (Megatron, possibly chained) copy its masters with stochastic
    rounding. `step()` returns the number of completed optimizer steps (the scheduler's count, which checkpoints
    restore). Returns the number of optimizers switched (0 for fp32 runs)."""
    n = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not getattr(getattr(opt, "config", None), "bf16", False) or not hasattr(
            opt, "_copy_main_params_to_model_params"
        ):
            continue
        copy = opt._copy_main_params_to_model_params

        def rounded_copy(opt=opt, copy=copy) -> None:
            masters = _bf16_masters(opt)
            exact = [m.detach().clone() for m in masters]
            gen = torch.Generator(device=masters[0].device if masters else "cpu")
            gen.manual_seed((int(seed) * 1_000_003 + int(step())) % (1 << 63))
            try:
                for m in masters:
                    stochastic_round_to_bf16_(m.data, gen)
                copy()  # Megatron's own copy (and, distributed, its shard bookkeeping): now exact
            finally:
                for m, e in zip(masters, exact):
                    m.data.copy_(e)

        opt._copy_main_params_to_model_params = rounded_copy
        n += 1
    return n
