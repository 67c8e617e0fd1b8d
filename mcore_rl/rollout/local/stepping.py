"""Which thread runs the local engine's steps, and how the threads that may run them take turns.

Two kinds of thread step the engine: the worker (`_loop`, started with the engine) and any caller blocked in
`wait` (`generate`, the trainer's rollout wait, evaluation), which runs the steps itself while the worker idles.
Why callers: each thread that runs torch ops gets its own OpenMP thread team, and with two teams alive on a small
machine libgomp manages more threads than CPUs, stops spinning and wakes its threads through the kernel for every
op: a [64, 576] fp32 multiply took 70-82 us on a second thread against 7 us on the main thread (2 cores), and the
main thread's own ops slowed to 22 us while the second team existed. Decoding on the caller's thread keeps one
team: decode steps 1.25x faster, and training in between is not slowed (docs/performance.md). The worker still
serves whoever does not wait (the async schedule, the HTTP server); after a submit or a caller's return it first
lets DRIVER_GRACE_S pass, so a caller about to wait takes the steps and the worker never starts a team of its own.

Admission and the step run under the model lock together (`_step_once`): one thread never admits rows while the
other's admitted rows are still prefilling. Callers that need the model between steps (weight updates, pause) go
through `_hold_model`, and both kinds of stepper let them in before their next step.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, wait
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from mcore_rl.rollout.local.kv_cache import MAX_RESERVE
from mcore_rl.rollout.local.rows import Row, sample_rows, tokens_left

if TYPE_CHECKING:
    from mcore_rl.rollout.local.decode_batch import DecodeBatch
    from mcore_rl.rollout.local.engine_stats import EngineStats
    from mcore_rl.rollout.protocol import Sample

log = logging.getLogger("mcore_rl.rollout.local.engine")
DRIVER_POLL_S = 0.05  # a driving caller with nothing to step re-checks its futures this often
DRIVER_GRACE_S = 0.05  # the worker waits this long after a submit / a caller's return before stepping itself


class Stepper:
    """The stepping half of LocalEngine: its state is set up by `_init_stepping`, the rest by the engine."""

    device: torch.device
    max_batch_size: int
    stats: EngineStats
    tokenizer: object
    _batch: DecodeBatch
    _version: int
    _index_free: bool

    def _init_stepping(self) -> None:
        # shared state, guarded by _cv
        self._cv = threading.Condition()
        self._pending: deque[Row] = deque()
        self._admitting: list[Row] = []
        self._paused = False
        self._released = False
        self._closing = False
        self._wake = False
        self._model_lock = threading.RLock()  # held by whoever steps, or by a `_hold_model` caller
        self._outside_waiters = 0  # callers waiting for _model_lock: steppers let them in before their next step
        self._drivers = 0  # callers running the steps themselves (`wait`): the worker idles meanwhile
        self._handoff = 0.0  # last submit or driver return (monotonic): the worker's grace starts there
        self._worker = threading.Thread(target=self._loop, name="local-rollout-engine", daemon=True)

    def _to_sample(self, row: Row) -> Sample:
        raise NotImplementedError

    @contextmanager
    def _hold_model(self) -> Iterator[None]:
        """_model_lock for a caller outside the loop, ahead of its next step (the loop retakes the unfair lock
        right after each step: a busy batch would starve a weight update until it drains)."""
        with self._cv:
            self._outside_waiters += 1
        try:
            with self._model_lock:
                yield
        finally:
            with self._cv:
                self._outside_waiters -= 1
                self._cv.notify_all()

    def wait(self, futures: Sequence[Future], timeout: float | None = None) -> bool:
        """Block until every future is done (True) or `timeout` seconds pass (False). On a CPU the calling thread
        runs the decode steps itself meanwhile and the worker idles: each thread that runs torch ops gets its own
        OpenMP team, and with two teams on a small machine libgomp wakes its threads through the kernel for every
        op (docs/performance.md: 7 -> 70 us per small multiply; decode 1.25x slower, training slower too)."""
        if not self._drives():
            return not wait(futures, timeout=timeout).not_done
        with self._driving():
            return self._drive(futures, timeout)

    def _drives(self) -> bool:
        """Whether the calling thread runs the steps while it waits: on a CPU, and never the worker itself."""
        return self.device.type == "cpu" and threading.current_thread() is not self._worker

    @contextmanager
    def _driving(self) -> Iterator[None]:
        """The worker idles while any caller is inside; on leaving, its grace starts."""
        with self._cv:
            self._drivers += 1
        try:
            yield
        finally:
            with self._cv:
                self._drivers -= 1
                self._handoff = time.monotonic()
                self._cv.notify_all()

    def _drive(self, futures: Sequence[Future], timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not all(f.done() for f in futures):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            with self._cv:
                if self._closing:
                    break
                if self._outside_waiters or not self._has_work():  # paused, or others' work in flight
                    self._cv.wait(DRIVER_POLL_S if left is None else min(DRIVER_POLL_S, left))
                    continue
            self._step_once()
        return all(f.done() for f in futures)

    def _loop(self) -> None:
        """Steps while nobody drives (`wait`); on a CPU, after a submit or a driver's return it first lets
        DRIVER_GRACE_S pass, so a caller about to wait (again) takes the steps and the worker never starts a thread
        team (on CUDA callers do not drive: no grace)."""
        while True:
            with self._cv:
                while not self._closing:
                    if self._outside_waiters or self._drivers or not self._has_work():
                        self._cv.wait()
                    elif (grace := self._grace_left()) > 0:
                        self._cv.wait(grace)
                    else:
                        break
                if self._closing:
                    return
            self._step_once()

    def _grace_left(self) -> float:
        if self.device.type != "cpu":
            return 0.0
        return DRIVER_GRACE_S - (time.monotonic() - self._handoff)

    def _step_once(self) -> None:
        """Admit the queued rows that fit and run one step, both under the model lock: with two stepping threads
        (the worker, callers in `wait`) one must not admit while the other's admitted rows are still prefilling."""
        with self._model_lock:
            with self._cv:
                if self._closing or self._outside_waiters or not self._has_work():
                    return
                self._wake = False
                admit = self._take_pending()
            try:
                with torch.inference_mode():
                    self._step(admit)
            except Exception as exc:  # fail the affected requests, keep serving
                log.exception("local engine step failed")
                for row in itertools.chain(self._batch.rows, admit):
                    if not row.future.done():
                        row.future.set_exception(exc)
                self._batch.reset()
            with self._cv:
                self._admitting = []
                self._cv.notify_all()

    def _has_work(self) -> bool:
        if self._wake:
            return True
        if self._paused or self._released:
            return False
        return bool(self._batch.rows or self._pending)

    def _take_pending(self) -> list[Row]:
        """Move queued rows into the batch (FIFO, up to max_batch_size); resolve queued aborts at once."""
        out: list[Row] = []
        keep: deque[Row] = deque()
        while self._pending:
            row = self._pending.popleft()
            if row.abort_requested:
                row.future.set_result(self._to_sample(row))
            elif self._paused or self._released or len(self._batch) + len(out) >= self.max_batch_size:
                keep.append(row)
            else:
                out.append(row)
        self._pending = keep
        self._admitting = out
        return out

    def _step(self, admit: list[Row]) -> None:
        self._retire()  # aborted rows leave before paying for another step
        batch = self._batch
        stats = self.stats
        if batch.rows and not self._paused:
            b, t0, c0 = len(batch), time.perf_counter(), time.process_time()
            batch.advance(self._sample(batch.rows, batch.decode()))
            stats.decode_s += time.perf_counter() - t0
            stats.decode_cpu_s += time.process_time() - c0
            stats.steps += 1
            stats.decode_tokens += b
            stats.batch_sizes.append(b)
            stats.kv_lengths.append(batch.mask.shape[1])
        if admit:
            t0, c0 = time.perf_counter(), time.process_time()
            reserve = min(max(map(tokens_left, itertools.chain(admit, batch.rows))), MAX_RESERVE)
            logits, part = batch.prefill([r.req.prompt_ids for r in admit], reserve)
            batch.add(admit, part, self._sample(admit, logits), reserve)
            stats.prefill_s += time.perf_counter() - t0
            stats.prefill_cpu_s += time.process_time() - c0
            stats.prefill_tokens += part.computed_tokens
        self._retire()

    def _sample(self, rows: list[Row], logits: torch.Tensor) -> torch.Tensor:
        return sample_rows(rows, logits, self._version, self.tokenizer, self._index_free)

    def _retire(self) -> None:
        """Finished / aborted rows leave the batch at once, so later steps get cheaper."""
        rows = self._batch.rows
        for row in rows:
            if row.abort_requested and row.finish is None:
                row.finish = "abort"
        done = [r for r in rows if r.finish is not None]
        if done:
            self._batch.keep([i for i, r in enumerate(rows) if r.finish is None])
            for row in done:
                row.future.set_result(self._to_sample(row))
