"""Rollout samples -> padded training tensors, grouped by prompt, plus the DP/mini-batch split.

Every sample keeps the weight version of each generated token (`versions`), so staleness is measurable per token.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from mcore_rl.policy.step import PolicyBatch


@dataclass
class RolloutBatch:
    tokens: torch.Tensor  # [N, L] prompt + response, right padded
    loss_mask: torch.Tensor  # [N, L] 1 on response tokens
    rollout_logp: torch.Tensor  # [N, L] engine log-probs at response positions
    versions: torch.Tensor  # [N, L] weight version per response token (-1 elsewhere)
    group_ids: torch.Tensor  # [N] prompt group index (global within the round)
    rewards: torch.Tensor  # [N]
    correct: torch.Tensor  # [N] 0/1 verifier verdict
    response_len: torch.Tensor  # [N]
    truncated: torch.Tensor  # [N] 0/1 finish_reason == length

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def select(self, rows: torch.Tensor | list[int]) -> RolloutBatch:
        idx = torch.as_tensor(rows, dtype=torch.long)
        return RolloutBatch(**{f.name: getattr(self, f.name)[idx] for f in fields(self)})

    def policy_batch(self, **extras: torch.Tensor) -> PolicyBatch:
        return PolicyBatch(self.tokens, self.loss_mask, dict(extras))


def build_rollout_batch(samples, rewards: list[float], correct: list[bool], group_ids: list[int],
                        pad_id: int = 0) -> RolloutBatch:
    n = len(samples)
    L = max(len(s.prompt_ids) + len(s.output_ids) for s in samples)
    tokens = torch.full((n, L), pad_id, dtype=torch.long)
    mask = torch.zeros(n, L)
    logp = torch.zeros(n, L)
    versions = torch.full((n, L), -1, dtype=torch.long)
    for i, s in enumerate(samples):
        p, o = len(s.prompt_ids), len(s.output_ids)
        tokens[i, :p] = torch.tensor(s.prompt_ids)
        if o:
            tokens[i, p:p + o] = torch.tensor(s.output_ids)
            mask[i, p:p + o] = 1.0 if s.output_mask is None else torch.tensor(s.output_mask, dtype=torch.float32)
            logp[i, p:p + o] = torch.tensor(s.output_logprobs, dtype=torch.float32)
            versions[i, p:p + o] = torch.tensor(s.weight_versions)
    return RolloutBatch(
        tokens=tokens, loss_mask=mask, rollout_logp=logp, versions=versions,
        group_ids=torch.tensor(group_ids, dtype=torch.long),
        rewards=torch.tensor(rewards, dtype=torch.float32),
        correct=torch.tensor([float(c) for c in correct]),
        response_len=torch.tensor([_policy_tokens(s) for s in samples], dtype=torch.float32),
        truncated=torch.tensor([float(s.finish_reason == "length") for s in samples]),
    )


def _policy_tokens(s) -> int:
    return len(s.output_ids) if s.output_mask is None else int(sum(s.output_mask))


def update_rows(group_ids: torch.Tensor, num_updates: int, update: int, dp: int, dp_rank: int) -> list[int]:
    """Rows of mini-batch `update` owned by DP rank `dp_rank`: whole prompt groups, never split across ranks."""
    groups = sorted(set(group_ids.tolist()))
    per = -(-len(groups) // num_updates)
    mine = groups[update * per:(update + 1) * per]
    owned = {g for i, g in enumerate(mine) if i % dp == dp_rank}
    return [i for i, g in enumerate(group_ids.tolist()) if g in owned]
