"""`optim.*`: AdamW and the learning-rate schedule (its decay length is trainer.steps, not a key of its own).

The one definition of these settings: the Hydra schema of the `optim` group is also what the policy's
optimizer builder takes (PolicyConfig.optim, policy/build.py), so a key cannot drift between the two."""

from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.config.checks import ConfigError, one_of, positive


@dataclass
class OptimSettings:
    lr: float = 2.0e-5
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    adam_eps: float = 1.0e-8
    clip_grad: float = 1.0          # global grad-norm clip (0 = off)
    warmup_steps: int = 0
    decay_style: str = "constant"   # constant | linear | cosine (from lr to min_lr over trainer.steps)
    use_distributed_optimizer: bool = False  # shard optimizer state over data-parallel ranks (Megatron)
    bf16_stochastic_rounding: bool = False  # bf16: masters -> bf16 weights rounded stochastically (no dead zone)

    def __post_init__(self) -> None:
        positive("optim.lr", self.lr)
        for key in ("min_lr", "weight_decay", "adam_eps", "clip_grad", "warmup_steps"):
            positive(f"optim.{key}", getattr(self, key), allow_zero=True)
        for key in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"optim.{key}={getattr(self, key)} must be in [0, 1)")
        if self.min_lr > self.lr:
            raise ConfigError(f"optim.min_lr={self.min_lr} must be <= optim.lr={self.lr}")
        one_of("optim.decay_style", self.decay_style, ("constant", "linear", "cosine"))
