"""A pool of verifier processes with a hard per-case deadline.

Why not concurrent.futures: a ProcessPoolExecutor cannot kill one stuck task (it breaks the whole pool), and
fork is unsafe once the trainer holds torch/gloo threads. Here every worker owns a pipe; the parent
dispatches one case per idle worker, waits on all pipes, and kills + replaces a worker whose case passes its
deadline, so one hang costs one case, never the batch. Workers are reused (startup paid once); with the
default forkserver context they fork from a pre-warmed server (warmup.py), so a replacement is ready in
~50 ms instead of the ~1.5 s (10+ s under load) a spawned interpreter needs to import sympy. The pool closes
on close(), garbage collection or interpreter exit; workers also exit on their own when the parent dies.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from mcore_rl.rewards.worker import MEMORY_LIMIT, CaseResult, WorkerOptions, worker_main

logger = logging.getLogger(__name__)


@dataclass
class _Worker:
    proc: Any  # multiprocessing.process.BaseProcess
    conn: Connection
    born: float
    ready: bool = False
    case: int | None = None
    started: float = 0.0
    served: int = 0


def _stop(w: _Worker, kill: bool) -> None:
    try:
        if not kill:
            w.conn.send(None)
    except (OSError, ValueError):
        kill = True
    if not kill:
        w.proc.join(timeout=2.0)
    if w.proc.is_alive():
        w.proc.kill()
        w.proc.join(timeout=5.0)
    w.conn.close()


def _shutdown(workers: list[_Worker]) -> None:
    """Finalizer body: must not reference the pool itself (weakref.finalize)."""
    for w in workers:
        try:
            w.conn.send(None)
        except (OSError, ValueError):
            pass
    for w in workers:
        _stop(w, kill=w.case is not None)  # a worker mid-case may be stuck: do not wait for it
    workers.clear()


def _preload_modules() -> list[str]:
    """What the forkserver imports once, so forked workers need not.

    Children re-run the parent's main module as __mp_main__. For a file (`python train.py`) '__main__'
    preloads it; for `python -m mcore_rl.train` (torchrun) only importing the module by name in the server
    makes that re-run cheap (its torch/megatron imports are then already in sys.modules).
    """
    mods = ["__main__"]
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None)
    if name and not name.endswith("__main__"):
        mods.append(name)
    return mods + ["mcore_rl.rewards.warmup"]


class VerifierPool:
    """Run cases in worker processes with per-case hard timeouts. Concurrent `map` calls are serialised.

    `target(conn, options)` is the worker loop (default: math-verify's `worker_main`); any function that
    speaks the same small protocol (send ("ready", pid), then answer (key, *case) with ("result", key, r))
    can reuse the pool, e.g. a sandboxed code-execution reward. `log_level`: of the per-worker kill and death
    lines (a caller that logs one summary per batch itself passes DEBUG).
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        mp_context: str = "forkserver",
        startup_timeout_s: float = 120.0,
        max_tasks_per_worker: int = 0,
        options: Any = None,
        target: Callable[[Connection, Any], None] = worker_main,
        log_level: int = logging.WARNING,
    ):
        if num_workers < 1:
            raise ValueError(f"reward num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"reward timeout_s must be > 0, got {timeout_s}")
        if mp_context not in ("spawn", "forkserver"):
            raise ValueError(f"reward mp_context must be 'spawn' or 'forkserver' (fork is unsafe), got {mp_context!r}")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = startup_timeout_s
        self.max_tasks_per_worker = max_tasks_per_worker
        self.options = options or WorkerOptions(cpu_limit_s=int(timeout_s) + 5)
        self._target = target
        self._log_level = log_level
        self._ctx = mp.get_context(mp_context)
        if mp_context == "forkserver" and target is worker_main:
            # Process-wide setting, read when the forkserver first starts: workers fork warm (see warmup.py).
            self._ctx.set_forkserver_preload(_preload_modules())
        self._workers: list[_Worker] = []
        self._startup_failures = 0
        self.respawns = 0
        self._lock = threading.Lock()
        self._generation = 0  # tags dispatches so a result can never land in another call's batch
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)
        for _ in range(num_workers):
            self._workers.append(self._spawn())

    # ---- process management -------------------------------------------------------------------------
    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=self._target, args=(child, self.options), daemon=True, name="mcore-rl-reward"
        )
        proc.start()
        child.close()  # only the worker holds its end: its death becomes EOF here
        return _Worker(proc=proc, conn=parent, born=time.monotonic())

    def _replace(self, w: _Worker, kill: bool) -> None:
        _stop(w, kill=kill)
        self._workers[self._workers.index(w)] = self._spawn()
        self.respawns += 1

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        """Stop all workers (idempotent). Also runs at garbage collection and interpreter exit."""
        self._finalizer()

    # ---- dispatch -------------------------------------------------------------------------------------
    def map(self, cases: list[tuple[str, str]]) -> list[tuple[CaseResult, float]]:
        """(response, gold) cases -> [(result, latency_s)], in order. Latency runs from dispatch to answer."""
        with self._lock:
            if self.closed:
                raise RuntimeError("VerifierPool is closed")
            self._generation += 1
            for w in list(self._workers):
                if w.case is not None:  # still busy with a case of an interrupted call: start it fresh
                    self._replace(w, kill=True)
            return self._map(cases)

    def _map(self, cases: list[tuple[str, str]]) -> list[tuple[CaseResult, float]]:
        gen = self._generation
        out: list[tuple[CaseResult, float] | None] = [None] * len(cases)
        pending = deque(range(len(cases)))
        remaining = len(cases)
        while remaining:
            now = time.monotonic()
            for w in self._workers:
                if w.ready and w.case is None and pending:
                    idx = pending.popleft()
                    try:
                        w.conn.send(((gen, idx), *cases[idx]))
                    except (OSError, ValueError):
                        pending.appendleft(idx)
                        self._on_crash(w, out, now)
                        continue
                    w.case, w.started = idx, time.monotonic()
            for conn in wait([w.conn for w in self._workers], timeout=self._wait_time()):
                w = next(x for x in self._workers if x.conn is conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    remaining -= self._on_crash(w, out, time.monotonic())
                    continue
                if msg[0] == "ready":
                    w.ready, self._startup_failures = True, 0
                else:
                    _, (msg_gen, idx), result = msg
                    if msg_gen != gen or idx != w.case:
                        continue  # cannot happen after the reset above; never trust it anyway
                    out[idx] = (result, time.monotonic() - w.started)
                    w.case = None
                    w.served += 1
                    remaining -= 1
                    if result[2] == MEMORY_LIMIT:
                        self._replace(w, kill=False)  # it exits after a memory-limit case: never send it another
                    elif self.max_tasks_per_worker and w.served >= self.max_tasks_per_worker:
                        self._replace(w, kill=False)  # recycle: sympy caches grow without bound
            remaining -= self._enforce_deadlines(out)
        return out  # type: ignore[return-value]

    def _wait_time(self) -> float:
        now = time.monotonic()
        deadlines = [w.started + self.timeout_s for w in self._workers if w.case is not None]
        deadlines += [w.born + self.startup_timeout_s for w in self._workers if not w.ready]
        return max(0.0, min(deadlines) - now) if deadlines else 1.0

    def _enforce_deadlines(self, out: list) -> int:
        done = 0
        now = time.monotonic()
        for w in list(self._workers):
            if w.case is not None and now >= w.started + self.timeout_s:
                out[w.case] = ((0.0, False, "timeout", None), now - w.started)
                done += 1
                logger.log(self._log_level, "reward worker pid=%s passed %.2fs on case %d: killed and replaced",
                           w.proc.pid, self.timeout_s, w.case)
                self._replace(w, kill=True)
            elif not w.ready and now >= w.born + self.startup_timeout_s:
                self._startup_failed(w, f"not ready after {self.startup_timeout_s:.0f}s")
        return done

    def _on_crash(self, w: _Worker, out: list, now: float) -> int:
        w.proc.join(timeout=1.0)  # reap it, so the exit code below is real
        if not w.ready:
            self._startup_failed(w, f"exited with code {w.proc.exitcode} during startup")
            return 0
        done = 0
        if w.case is not None:
            out[w.case] = ((0.0, False, "worker_crash", None), now - w.started)
            done = 1
        logger.log(self._log_level, "reward worker pid=%s died (exit code %s); replaced", w.proc.pid,
                   w.proc.exitcode)
        self._replace(w, kill=True)
        return done

    def _startup_failed(self, w: _Worker, why: str) -> None:
        self._startup_failures += 1
        if self._startup_failures >= 3:
            self.close()
            raise RuntimeError(
                f"reward worker {why} 3 times in a row; check that the main script has an "
                "`if __name__ == '__main__':` guard (spawn re-imports it) and that the worker's imports work "
                "(math-verify, a reward function's module: its traceback is on stderr)"
            )
        logger.warning("reward worker pid=%s %s; retrying", w.proc.pid, why)
        self._replace(w, kill=True)
