"""Trajectories -> the trainer's padded batch fields, and episode metrics.

The fields are named like `RolloutBatch`'s (`RolloutBatch(**trajectory_tensors(...))`): the only difference from a
single-turn batch is that `loss_mask` has holes (tool / environment tokens between model turns are 0), so every
loss, aggregation denominator and statistic that reads the mask counts policy tokens only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from mcore_rl.envs.base import Trajectory

TRUNCATIONS = ("length", "max_total_tokens")


def trajectory_tensors(
    trajs: Sequence[Trajectory], group_ids: Sequence[int], pad_id: int = 0
) -> dict[str, torch.Tensor]:
    """Right-padded [N, L] tokens / loss_mask / rollout_logp / versions plus per-row rewards and counts."""
    if len(trajs) != len(group_ids):
        raise ValueError(f"{len(trajs)} trajectories but {len(group_ids)} group_ids")
    n, L = len(trajs), max((len(t.token_ids) for t in trajs), default=0)
    tokens = torch.full((n, L), pad_id, dtype=torch.long)
    mask = torch.zeros(n, L)
    logp = torch.zeros(n, L)
    versions = torch.full((n, L), -1, dtype=torch.long)
    for i, t in enumerate(trajs):
        k = len(t.token_ids)
        tokens[i, :k] = torch.tensor(t.token_ids, dtype=torch.long)
        mask[i, :k] = torch.tensor(t.mask, dtype=torch.float32)
        logp[i, :k] = torch.tensor(t.logprobs, dtype=torch.float32)
        versions[i, :k] = torch.tensor(t.versions, dtype=torch.long)
    return {
        "tokens": tokens,
        "loss_mask": mask,
        "rollout_logp": logp * mask,
        "versions": versions,
        "group_ids": torch.tensor(list(group_ids), dtype=torch.long),
        "rewards": torch.tensor([t.reward for t in trajs], dtype=torch.float32),
        "correct": torch.tensor([float(t.correct) for t in trajs]),
        "response_len": torch.tensor([float(t.policy_tokens) for t in trajs]),
        "truncated": torch.tensor([float(t.termination in TRUNCATIONS) for t in trajs]),
    }


def episode_metrics(trajs: Sequence[Trajectory], prefix: str = "env/") -> dict[str, float]:
    """Success, turns, tool-call validity and why episodes ended (fractions), for logs and evaluation."""
    if not trajs:
        return {}
    n = len(trajs)
    calls = sum(t.tool_calls for t in trajs)
    out = {
        "success": sum(t.correct for t in trajs) / n,
        "reward": sum(t.reward for t in trajs) / n,
        "turns": sum(t.turns for t in trajs) / n,
        "tool_calls": calls / n,
        "valid_tool_call_rate": (sum(t.valid_tool_calls for t in trajs) / calls) if calls else 0.0,
        "policy_token_frac": sum(t.policy_tokens for t in trajs)
        / max(1, sum(len(t.token_ids) - t.prompt_len for t in trajs)),
    }
    for reason, k in Counter(t.termination for t in trajs).items():
        out[f"end_{reason}"] = k / n
    return {prefix + k: float(v) for k, v in out.items()}
