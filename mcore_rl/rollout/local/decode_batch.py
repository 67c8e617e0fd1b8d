"""The tensor side of continuous batching for the local engine: model calls and batch surgery.

Rows are left-padded; each row carries its own position ids, so rows of different lengths (and rows that
joined later) share one KV cache. The engine decides what to sample and when rows finish; this class keeps
the cache, mask, positions and last tokens consistent while rows join (`add`) and leave (`keep`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.rollout.local.kv_cache import KVCache


@dataclass
class Prefill:
    """Freshly prefilled rows, waiting to be merged once their first tokens are sampled."""

    cache: KVCache
    mask: torch.Tensor  # [n, width] bool, left padded
    next_pos: torch.Tensor  # [n] position of the token sampled from the prefill logits


def _left_pad(mask: torch.Tensor, width: int) -> torch.Tensor:
    return torch.cat([mask.new_zeros(mask.shape[0], width - mask.shape[1]), mask], dim=1)


class DecodeBatch:
    def __init__(self, model: torch.nn.Module, num_layers: int, pad_id: int, device: torch.device) -> None:
        self.model, self.num_layers, self.pad_id, self.device = model, num_layers, pad_id, device
        self.rows: list[Any] = []
        self.cache: KVCache | None = None
        self.mask: torch.Tensor | None = None  # [B, L] bool: which cache columns each row attends to
        self.pos: torch.Tensor | None = None  # [B] position id of `last`
        self.last: torch.Tensor | None = None  # [B] last sampled token, fed at the next decode step

    def __len__(self) -> int:
        return len(self.rows)

    def reset(self) -> None:
        self.rows, self.cache, self.mask, self.pos, self.last = [], None, None, None, None

    def prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, Prefill]:
        """Run the prompts (left padded, logits of the last position only) into a fresh cache."""
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = True
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache = KVCache(self.num_layers)
        logits = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.long().cumsum(-1) - 1).clamp_(min=0),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        next_pos = torch.tensor([len(p) for p in prompts], device=self.device)
        return logits, Prefill(cache, mask, next_pos)

    def add(self, rows: list[Any], part: Prefill, first_tokens: torch.Tensor) -> None:
        """Merge prefilled rows into the running batch (both sides left-padded to the longer cache)."""
        if not self.rows:
            self.rows, self.cache, self.mask = list(rows), part.cache, part.mask
            self.pos, self.last = part.next_pos, first_tokens
            return
        width = max(self.mask.shape[1], part.mask.shape[1])
        self.cache = KVCache.merge(self.cache, part.cache)
        self.mask = torch.cat([_left_pad(self.mask, width), _left_pad(part.mask, width)])
        self.pos = torch.cat([self.pos, part.next_pos])
        self.last = torch.cat([self.last, first_tokens])
        self.rows = self.rows + list(rows)

    def decode(self) -> torch.Tensor:
        """One step for every row: feed `last`, return next-token logits [B, V]."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], dim=1)
        return self.model(
            input_ids=self.last.unsqueeze(1),
            attention_mask=self.mask,
            position_ids=self.pos.unsqueeze(1),
            past_key_values=self.cache,
            use_cache=True,
        ).logits[:, -1]

    def advance(self, tokens: torch.Tensor) -> None:
        self.last, self.pos = tokens, self.pos + 1

    def keep(self, indices: list[int]) -> None:
        """Only these rows stay: index-select the cache, then crop columns no remaining row attends to."""
        if len(indices) == len(self.rows):
            return
        if not indices:
            self.reset()
            return
        idx = torch.tensor(indices, device=self.device)
        self.cache.select(idx)
        self.mask, self.pos, self.last = self.mask[idx], self.pos[idx], self.last[idx]
        lead = int(self.mask.any(dim=0).long().argmax())  # first column any remaining row attends to
        if lead > 0:
            self.cache.crop_left(lead)
            self.mask = self.mask[:, lead:]
        self.rows = [self.rows[i] for i in indices]
