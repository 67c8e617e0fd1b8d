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
from mcore_rl.rollout.protocol import Sample

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


def episode_summary(t: Trajectory) -> dict:
    """What the metrics need of an episode, small enough to travel with a trainer sample (and its checkpoint)."""
    return {
        "reward": float(t.reward),
        "correct": bool(t.correct),
        "turns": t.turns,
        "tool_calls": t.tool_calls,
        "valid_tool_calls": t.valid_tool_calls,
        "termination": t.termination,
        "policy_tokens": t.policy_tokens,
        "env_tokens": len(t.token_ids) - t.prompt_len,
    }


def trajectory_sample(t: Trajectory, rid: str | None = None) -> Sample:
    """An episode as one trainer sample: the first prompt, then every later token (policy and tool/environment)
    as output with `output_mask` marking the policy's. The episode's reward and counters ride in
    `metadata["episode"]` (episode_summary), so the trainer's rounds, checkpoints and old-log-prob sources handle
    an episode exactly like a single-turn sample."""
    p = t.prompt_len
    reason = "length" if t.termination in TRUNCATIONS else "abort" if t.termination == "abort" else "stop"
    return Sample(rid=rid or t.metadata.get("rid"), prompt_ids=list(t.token_ids[:p]), output_ids=list(t.token_ids[p:]),
                  output_logprobs=list(t.logprobs[p:]), weight_versions=list(t.versions[p:]), finish_reason=reason,
                  text=next((m["content"] for m in reversed(t.messages) if m["role"] == "assistant"), ""),
                  sample_index=t.sample_index, metadata={"episode": episode_summary(t)},
                  output_mask=list(t.mask[p:]))  # fmt: skip


def episode_metrics(trajs: Sequence[Trajectory], prefix: str = "env/") -> dict[str, float]:
    """Success, turns, tool-call validity and why episodes ended (fractions), for logs and evaluation."""
    return summary_metrics([episode_summary(t) for t in trajs], prefix)


def summary_metrics(episodes: Sequence[dict], prefix: str = "env/") -> dict[str, float]:
    """episode_metrics over `episode_summary` records (what a trainer round holds)."""
    if not episodes:
        return {}
    n = len(episodes)
    calls = sum(e["tool_calls"] for e in episodes)
    out = {
        "success": sum(e["correct"] for e in episodes) / n,
        "reward": sum(e["reward"] for e in episodes) / n,
        "turns": sum(e["turns"] for e in episodes) / n,
        "tool_calls": calls / n,
        "valid_tool_call_rate": (sum(e["valid_tool_calls"] for e in episodes) / calls) if calls else 0.0,
        "policy_token_frac": sum(e["policy_tokens"] for e in episodes)
        / max(1, sum(e["env_tokens"] for e in episodes)),
    }
    for reason, k in Counter(e["termination"] for e in episodes).items():
        out[f"end_{reason}"] = k / n
    return {prefix + k: float(v) for k, v in out.items()}
