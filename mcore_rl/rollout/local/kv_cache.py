"""A batch-editable KV cache for the in-process engine.

Why not HF's DynamicCache as is: it re-concatenates the whole cache every decode step (a full copy per token),
and it cannot drop left-padding columns or merge two batches. Here each layer keeps a buffer preallocated for the
prompt plus the longest `max_new_tokens` admitted (`reserve`, at most MAX_RESERVE), so a decode step is one small
write and never a reallocation (past the reservation it grows by doubling); a finished row leaves by a row from the
tail moving into its slot, all-padding columns on the left are cropped (a view, no copy), rows sharing a prompt are
expanded from one prefill (`select` with repeated indices), and newly admitted rows are merged in (continuous
batching).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

_HEADROOM = 64
# columns reserved at admission at most: a batch of long-budget requests (max_new_tokens in the thousands) whose
# samples mostly stop early must not allocate the whole budget for every row up front; past this it doubles
MAX_RESERVE = 256


class GrowingLayer(DynamicLayer):
    """One layer's K/V in buffers of shape [batch, kv_heads, capacity, head_dim]; the first `length` columns live."""

    def __init__(self, reserve: int = _HEADROOM) -> None:
        super().__init__()
        self._reserve = max(int(reserve), 1)
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        self._len = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, n, d = key_states.shape
        self._kbuf = key_states.new_zeros(b, h, n + self._reserve, d)
        self._vbuf = value_states.new_zeros(
            b, value_states.shape[1], n + self._reserve, value_states.shape[-1]
        )
        self._len = 0
        self.is_initialized = True

    def _refresh(self) -> None:
        self.keys = self._kbuf[:, :, : self._len]
        self.values = self._vbuf[:, :, : self._len]

    def _ensure_capacity(self, needed: int) -> None:
        cap = self._kbuf.shape[2]
        if needed <= cap:
            return
        new_cap = max(needed + _HEADROOM, 2 * cap)
        for name in ("_kbuf", "_vbuf"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], old.shape[1], new_cap, old.shape[3])
            new[:, :, : self._len] = old[:, :, : self._len]
            setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self._len + key_states.shape[2]
        self._ensure_capacity(end)
        self._kbuf[:, :, self._len : end] = key_states
        self._vbuf[:, :, self._len : end] = value_states
        self._len = end
        self._refresh()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._len if self.is_initialized else 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._kbuf = _select_rows(self._kbuf, indices, self._len)
            self._vbuf = _select_rows(self._vbuf, indices, self._len)
            self._refresh()

    def move_rows(self, dst: torch.Tensor, src: torch.Tensor, rows: int) -> None:
        """Copy rows `src` into rows `dst` (disjoint sets), then keep the first `rows` rows (a view, no copy)."""
        if self.is_initialized:
            for name in ("_kbuf", "_vbuf"):
                buf = getattr(self, name)
                if len(dst):
                    live = buf[:, :, : self._len]
                    live.index_copy_(0, dst, live.index_select(0, src))
                setattr(self, name, buf[:rows])
            self._refresh()

    def crop_left(self, n: int) -> None:
        """Drop the first n columns (all-padding once the rows that needed them have left)."""
        if self.is_initialized and n > 0:
            self._kbuf = self._kbuf[:, :, n:]
            self._vbuf = self._vbuf[:, :, n:]
            self._len -= n
            self._refresh()

    def padded_left(self, length: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K/V left-padded with zeros to `length` live columns inside `capacity` columns."""
        pad = length - self._len
        out = []
        for buf in (self._kbuf, self._vbuf):
            new = buf.new_zeros(buf.shape[0], buf.shape[1], capacity, buf.shape[3])
            new[:, :, pad:length] = buf[:, :, : self._len]
            out.append(new)
        return out[0], out[1]


def _select_rows(buf: torch.Tensor, indices: torch.Tensor, live: int) -> torch.Tensor:
    """Rows `indices` of `buf` in a new buffer of the same capacity, only the `live` columns copied (the rest is
    written before it is read). Why not `buf[indices]`: advanced indexing copies every reserved column too and
    runs ~4x slower on a CPU (SmolLM2 fp32, 64 rows, ~100 of 160 columns live: 846 vs 213 us per buffer), for
    each of the 2 x layers buffers of every admission that expands a prompt to its n samples."""
    out = buf.new_empty(len(indices), *buf.shape[1:])
    torch.index_select(buf[:, :, :live], 0, indices, out=out[:, :, :live])
    return out


class KVCache(Cache):
    """HF `Cache` of GrowingLayers with batch surgery: select rows, crop left padding, merge batches."""

    def __init__(self, num_layers: int, reserve: int = _HEADROOM) -> None:
        super().__init__(layers=[GrowingLayer(reserve) for _ in range(num_layers)])

    @property
    def seq_length(self) -> int:
        return self.layers[0].get_seq_length()

    def select(self, indices: torch.Tensor) -> None:
        for layer in self.layers:
            layer.batch_select_indices(indices)

    def drop_rows(self, keep: list[int]) -> list[int]:
        """Drop every row not in `keep` (ascending) by moving kept rows from the tail into the vacated slots: a
        row that finishes costs one row's copy, not the whole batch's (SmolLM2 fp32, 36 rows: ~14 ms of copying
        per finishing step when every later row shifted down). Returns the new order: new row i is old row
        order[i]; the caller reorders its per-row state alike."""
        n, kept = len(keep), set(keep)
        holes = [i for i in range(n) if i not in kept]
        tail = [i for i in keep if i >= n]  # as many as there are holes
        order = list(range(n))
        for hole, row in zip(holes, tail):
            order[hole] = row
        device = self.layers[0]._kbuf.device if self.layers[0].is_initialized else None
        dst, src = torch.tensor(holes, device=device), torch.tensor(tail, device=device)
        for layer in self.layers:
            layer.move_rows(dst, src, n)
        return order

    def crop_left(self, n: int) -> None:
        for layer in self.layers:
            layer.crop_left(n)

    @property
    def capacity(self) -> int:
        """Columns the buffers hold before the next reallocation."""
        layer = self.layers[0]
        return layer._kbuf.shape[2] if layer.is_initialized else 0

    @staticmethod
    def merge(a: KVCache, b: KVCache, reserve: int = _HEADROOM) -> KVCache:
        """Rows of `a` then rows of `b`, both left-padded (zeros, masked by the caller) to the longer length."""
        length = max(a.seq_length, b.seq_length)
        out = KVCache(len(a.layers), reserve)
        for la, lb, lo in zip(a.layers, b.layers, out.layers):
            ka, va = la.padded_left(length, length + max(reserve, 1))
            kb, vb = lb.padded_left(length, length + max(reserve, 1))
            lo.dtype, lo.device, lo.is_initialized = ka.dtype, ka.device, True
            lo._kbuf, lo._vbuf, lo._len = torch.cat([ka, kb]), torch.cat([va, vb]), length
            lo._refresh()
        return out


def check_full_attention(config) -> None:
    """The cache above keeps every key, so full attention and sliding windows are exact (transformers' own
    per-layer masks apply a window by position, tests/models/test_engine_windows.py); other layer types (chunked,
    linear/hybrid attention) are refused clearly."""
    text_config = config.get_text_config(decoder=True)
    layer_types = getattr(text_config, "layer_types", None) or ["full_attention"]
    other = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if other:
        raise NotImplementedError(
            f"local rollout engine supports full and sliding-window attention only; {type(text_config).__name__} "
            f"has layer types {other} -- use the sglang engine for it"
        )
