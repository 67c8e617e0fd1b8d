"""Agentic multi-turn environments: episodes of model turns interleaved with tool and environment text.

`build_environment(cfg)` makes an environment from its config (`hydra_conf/env/*.yaml`); `EpisodeRunner` runs a
batch of episodes against a RolloutEngine and returns `Trajectory`s (token ids, policy mask, per-token log-probs
and weight versions, rewards, metadata); `trajectory_tensors` pads them into the trainer's batch fields.
See docs/environments.md.
"""

from mcore_rl.envs.base import (
    ENVS,
    EnvConfig,
    Environment,
    Episode,
    Feedback,
    Tool,
    Trajectory,
    build_environment,
)

__all__ = [
    "ENVS",
    "EnvConfig",
    "Environment",
    "Episode",
    "Feedback",
    "Tool",
    "Trajectory",
    "build_environment",
]
