"""The tensor side of continuous batching for the local engine: model calls and batch surgery.

Rows are left-padded; each row carries its own position ids, so rows of different lengths (and rows that
joined later) share one KV cache. The engine decides what to sample and when rows finish; this class keeps
the cache, mask, positions and last tokens consistent while rows join (`add`) and leave (`keep`).

Rows with the same prompt (the n samples of a request) are prefilled once and their KV expanded to the n rows:
with 4 samples per prompt that is a quarter of the prefill FLOPs. The KV buffers and the attention mask are
allocated for the longest response admitted (`reserve`), so a decode step writes one column in place and
allocates nothing that grows with the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.rollout.local.decode_forward import DecodeForward, unsupported
from mcore_rl.rollout.local.kv_cache import KVCache
from mcore_rl.rollout.local.lm_head import LastLogits


@dataclass
class Prefill:
    """Freshly prefilled rows, waiting to be merged once their first tokens are sampled."""

    cache: KVCache
    mask: torch.Tensor  # [n, width] bool, left padded
    next_pos: torch.Tensor  # [n] position of the token sampled from the prefill logits
    computed_tokens: int  # prompt tokens actually run through the model (each distinct prompt once)


def _left_pad(mask: torch.Tensor, width: int) -> torch.Tensor:
    return torch.cat([mask.new_zeros(mask.shape[0], width - mask.shape[1]), mask], dim=1)


def distinct_prompts(prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """(each distinct prompt once, in first-seen order; for every row the index of its prompt in that list)."""
    first: dict[tuple[int, ...], int] = {}
    inverse = [first.setdefault(tuple(p), len(first)) for p in prompts]
    return [list(p) for p in first], inverse


class DecodeBatch:
    def __init__(self, model: torch.nn.Module, num_layers: int, pad_id: int, device: torch.device) -> None:
        self.model, self.num_layers, self.pad_id, self.device = model, num_layers, pad_id, device
        self.last_logits = LastLogits(model)
        self.fused: DecodeForward | None = None  # the engine's own decode step (decode_forward.py), when set
        self.rows: list[Any] = []
        self.cache: KVCache | None = None
        self.mask: torch.Tensor | None = None  # [B, L] bool view of _mask_buf: columns each row attends to
        self._mask_buf: torch.Tensor | None = None  # [B, capacity] bool, columns >= L not yet written
        self.pos: torch.Tensor | None = None  # [B] position id of `last`
        self.last: torch.Tensor | None = None  # [B] last sampled token, fed at the next decode step

    def __len__(self) -> int:
        return len(self.rows)

    def reset(self) -> None:
        self.rows, self.cache, self.mask, self.pos, self.last = [], None, None, None, None
        self._mask_buf = None

    def use_fused(self, enabled: bool, in_major: bool = False) -> str | None:
        """Decode through DecodeForward (enabled and the model covered exactly), else the model's own forward;
        in_major: its layer weights stored [in, out] (weight_layout.py). Returns why the fused forward is off, or
        None when it is on."""
        reason = "disabled" if not enabled else unsupported(self.model)
        if reason is None and self.last_logits.head is None:
            reason = "LM head is not a plain lm_head(hidden)"
        if reason is None and self.fused is None:
            self.fused = DecodeForward(self.model, in_major)
        elif reason is not None:
            self.fused = None
        self.set_layout(in_major)
        return reason

    def set_layout(self, in_major: bool) -> None:
        """Layer weights [in, out] (in_major) or [out, in] for the fused forward; the LM head's CPU form goes with
        them: regrouped with [out, in], the plain product with [in, out] (the machine class `auto` measured,
        weight_layout.py)."""
        if self.fused is not None:
            self.fused.set_layout(in_major)
        self.last_logits.regroup = not in_major

    def refresh_fused(self) -> None:
        """After a weight update: the fused forward re-fuses and drops its fp32 copies; so does the LM head."""
        self.last_logits.wide.clear()
        if self.fused is not None:
            self.fused.refresh()

    def _set_mask(self, mask: torch.Tensor, capacity: int) -> None:
        """Copy `mask` into a fresh [B, capacity] buffer; decode steps then extend it in place."""
        buf = mask.new_zeros(mask.shape[0], max(capacity, mask.shape[1] + 1))
        buf[:, : mask.shape[1]] = mask
        self._mask_buf, self.mask = buf, buf[:, : mask.shape[1]]

    def prefill(self, prompts: list[list[int]], reserve: int = 64) -> tuple[torch.Tensor, Prefill]:
        """Run each distinct prompt once (left padded, logits of the last position only) into a fresh cache with
        room for `reserve` more tokens, then expand cache, mask and logits to one row per entry of `prompts`."""
        unique, inverse = distinct_prompts(prompts)
        width = max(map(len, unique))
        ids = torch.full((len(unique), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(unique), width), dtype=torch.bool)
        for i, p in enumerate(unique):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = True
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache = KVCache(self.num_layers, reserve)
        logits = self.last_logits(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.long().cumsum(-1) - 1).clamp_(min=0),
            past_key_values=cache,
            use_cache=True,
        )
        if len(unique) < len(prompts):  # shared prefixes: every sample of a prompt gets a copy of its KV
            idx = torch.tensor(inverse, device=self.device)
            cache.select(idx)
            logits, mask = logits[idx], mask[idx]
        next_pos = torch.tensor([len(p) for p in prompts], device=self.device)
        return logits, Prefill(cache, mask, next_pos, sum(map(len, unique)))

    def add(self, rows: list[Any], part: Prefill, first_tokens: torch.Tensor, reserve: int = 64) -> None:
        """Merge prefilled rows into the running batch (both sides left-padded to the longer cache); `reserve`:
        decode steps the merged batch still needs at most (sizes the merged buffers)."""
        if not self.rows:
            self.rows, self.cache = list(rows), part.cache
            self._set_mask(part.mask, part.cache.capacity)
            self.pos, self.last = part.next_pos, first_tokens
            return
        width = max(self.mask.shape[1], part.mask.shape[1])
        self.cache = KVCache.merge(self.cache, part.cache, reserve)
        self._set_mask(
            torch.cat([_left_pad(self.mask, width), _left_pad(part.mask, width)]), self.cache.capacity
        )
        self.pos = torch.cat([self.pos, part.next_pos])
        self.last = torch.cat([self.last, first_tokens])
        self.rows = self.rows + list(rows)

    def decode(self) -> torch.Tensor:
        """One step for every row: feed `last`, return next-token logits [B, V]."""
        width = self.mask.shape[1]
        if width == self._mask_buf.shape[1]:  # outgrew the reservation (only if a merge under-reserved)
            self._set_mask(self.mask, 2 * width)
        self._mask_buf[:, width] = True
        self.mask = self._mask_buf[:, : width + 1]
        if self.fused is not None:
            hidden = self.fused(self.last, self.pos, self.mask, self.cache)
            return self.last_logits.of(hidden)
        return self.last_logits(
            input_ids=self.last.unsqueeze(1),
            attention_mask=self.mask,
            position_ids=self.pos.unsqueeze(1),
            past_key_values=self.cache,
            use_cache=True,
        )

    def advance(self, tokens: torch.Tensor) -> None:
        self.last, self.pos = tokens, self.pos + 1

    def keep(self, indices: list[int]) -> None:
        """Only these rows stay (kept rows from the tail move into the vacated slots, so the order changes),
        then crop the columns no remaining row attends to."""
        if len(indices) == len(self.rows):
            return
        if not indices:
            self.reset()
            return
        order = self.cache.drop_rows(indices)  # rows from the tail fill the vacated slots
        idx = torch.tensor(order, device=self.device)
        self.pos, self.last = self.pos[idx], self.last[idx]
        width = self.mask.shape[1]
        buf = self._mask_buf[idx]
        lead = int(buf[:, :width].any(dim=0).long().argmax())  # first column any remaining row attends to
        if lead > 0:
            self.cache.crop_left(lead)
        self._mask_buf, self.mask = buf[:, lead:], buf[:, lead:width]
        self.rows = [self.rows[i] for i in order]
