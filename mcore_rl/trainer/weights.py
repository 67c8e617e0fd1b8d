"""Weights: the trainer's live weights into the rollout engine, and the old-log-prob source told of each version.

Every rank takes part (the policy's shards are gathered to rank 0, which owns the engine); the version number
is the run state's, bumped here, so samples, checkpoints and the old-log-prob source agree on it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mcore_rl.config import LocalRolloutConfig, SGLangRolloutConfig
from mcore_rl.rollout.weight_sync.megatron_sync import sync_weights
from mcore_rl.rollout.weight_sync.transports import SyncOptions
from mcore_rl.trainer.state import RunState


class WeightSync:
    """`enabled` (trainer.sync_weights) false: the engine keeps its initial weights and the version stays 0."""

    def __init__(
        self,
        policy: Any,
        engine: Any,
        mode: str,
        options: SyncOptions,
        enabled: bool,
        oldlogp: Any,
        finished: Callable[[], list] | None,
    ) -> None:
        self.policy, self.engine, self.mode, self.options = policy, engine, mode, options
        self.enabled, self.oldlogp, self.finished = enabled, oldlogp, finished

    def publish(self, state: RunState) -> dict[str, float]:
        """A new version: the engine loads the updated weights, then the old-log-prob source records them."""
        if not self.enabled:
            return {}
        state.version += 1
        out = sync_weights(self.policy, self.engine, state.version, mode=self.mode, options=self.options)
        self.announce(state.version)
        return out

    def reload(self, version: int) -> None:
        """Resume (or a Megatron start checkpoint): the engine gets the restored weights under their version."""
        if self.enabled:
            sync_weights(self.policy, self.engine, version, mode=self.mode, options=self.options)

    def announce(self, version: int) -> None:
        """The old-log-prob source learns which version is live (at start and after every sync)."""
        self.oldlogp.on_version(version, self.finished)


def sync_options(rollout: LocalRolloutConfig | SGLangRolloutConfig, model_dir: Path) -> SyncOptions:
    """The trainer's side of weight sync from the rollout settings (bucket_mb: SGLang's tensor/nccl payloads;
    the embedded engine copies tensors in memory, unbucketed)."""
    extra = {"bucket_mb": rollout.bucket_mb} if isinstance(rollout, SGLangRolloutConfig) else {}
    return SyncOptions(
        sync_dir=rollout.sync_dir, config_dir=model_dir, keep_versions=rollout.keep_versions, **extra
    )
