"""PromptSampler: seeded per-epoch shuffling, fixed-size prompt batches, an exactly resumable cursor.

Why the order is a pure function of (seed, epoch): the cursor is then just (epoch, position), so a resumed
run yields the very batches an uninterrupted run would, with nothing but two integers in the checkpoint.
Batches run across epoch boundaries, so every batch has `batch_size` prompts.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from mcore_rl.data.records import PromptRecord


def _fingerprint(dataset: Sequence[PromptRecord]) -> str:
    h = hashlib.sha1()
    for rec in dataset:
        h.update(rec.prompt_id.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()[:16]


class PromptSampler:
    """`skip(prompt_id) -> True` drops a prompt when it comes up (e.g. ScaleRL's no-positive-resampling)."""

    def __init__(
        self,
        dataset: Sequence[PromptRecord],
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        skip: Callable[[str], bool] | None = None,
    ):
        if len(dataset) == 0:
            raise ValueError("PromptSampler: the dataset is empty")
        if batch_size < 1:
            raise ValueError(f"PromptSampler: batch_size must be >= 1, got {batch_size}")
        self.dataset, self.batch_size, self.seed, self.shuffle, self.skip = dataset, batch_size, seed, shuffle, skip
        self.epoch = 0
        self.position = 0  # index into this epoch's order of the next prompt to consider
        self.batches_served = 0
        self._fingerprint = _fingerprint(dataset)
        self._order_epoch = -1
        self._order: list[int] = []

    def order(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            self._order = list(range(len(self.dataset)))
            if self.shuffle:
                random.Random(f"mcore_rl.sampler:{self.seed}:{epoch}").shuffle(self._order)
            self._order_epoch = epoch
        return self._order

    def next_batch(self) -> list[PromptRecord]:
        n = len(self.dataset)
        batch: list[PromptRecord] = []
        skipped_in_a_row = 0
        while len(batch) < self.batch_size:
            if self.position >= n:
                self.epoch, self.position = self.epoch + 1, 0
            rec = self.dataset[self.order(self.epoch)[self.position]]
            self.position += 1
            if self.skip is not None and self.skip(rec.prompt_id):
                skipped_in_a_row += 1
                if skipped_in_a_row >= n:
                    raise RuntimeError(f"PromptSampler: all {n} prompts are skipped by the skip() callback")
                continue
            skipped_in_a_row = 0
            batch.append(rec)
        self.batches_served += 1
        return batch

    def __iter__(self) -> Iterator[list[PromptRecord]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Plain ints/strs: safe for torch.save and weights_only=True loading."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "batches_served": self.batches_served,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_prompts": len(self.dataset),
            "fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        mine = self.state_dict()
        for key in ("seed", "shuffle", "num_prompts", "fingerprint"):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"PromptSampler.load_state_dict: {key} is {state.get(key)!r} in the checkpoint but {mine[key]!r} "
                    "now; resuming on a different dataset/seed would not reproduce the run"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.batches_served = int(state["batches_served"])


def build_sampler(
    dataset: Sequence[PromptRecord], data_cfg: Mapping[str, Any] | Any, batch_size: int,
    skip: Callable[[str], bool] | None = None,
) -> PromptSampler:
    """Reads the optional `sampler: {seed, shuffle}` section of a data yaml."""
    section = dict((data_cfg or {}).get("sampler") or {})
    unknown = sorted(set(section) - {"seed", "shuffle"})
    if unknown:
        raise ValueError(f"data.sampler: unknown option(s) {unknown}; known: ['seed', 'shuffle']")
    return PromptSampler(dataset, batch_size, seed=int(section.get("seed", 0)),
                         shuffle=bool(section.get("shuffle", True)), skip=skip)
