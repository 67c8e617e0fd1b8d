"""The math-verify worker process: extraction + parse + verify for one case at a time.

Why a process: math-verify/sympy can hang inside C code (`9**9**9`), which no in-process timeout can stop,
and its own timeouts use signal.alarm, which raises in threads. So math-verify runs here with its timeouts
off and the parent kills the worker at the per-case deadline. No in-process timer on purpose: an alarm that
fires mid-import or mid-cache-update leaves a half-initialised process that fails every later case (seen
under load: AttributeError on every gold). RLIMIT_CPU bounds a worker whose parent died mid-case; RLIMIT_AS bounds
its memory (sympy on adversarial input can allocate without bound): past it the case scores 0 with reason
`memory_limit` and the worker exits, so the pool replaces it with a clean one.

`WorkerOptions.fault` carries the fault suite's reward hook (mcore_rl/faults.py), read by the parent when the options
are made.
"""

from __future__ import annotations

import functools
import logging
import os
import resource
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mcore_rl.faults import act_reward_fault, reward_fault
from mcore_rl.rewards.extract import extract_answer, max_brace_depth

# (score, correct, reason, extracted): a plain tuple crosses the pipe cheaply.
CaseResult = tuple[float, bool, str, str | None]
MEMORY_LIMIT = "memory_limit"


def _vm_size_bytes() -> int:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def limit_address_space(extra_mb: int) -> None:
    """Cap this process's address space at its current size + `extra_mb` (0 = no cap). Relative on purpose: a
    worker forked from a server that imported torch already maps gigabytes it never touches."""
    if extra_mb <= 0:
        return
    limit = _vm_size_bytes() + extra_mb * 2**20
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


@dataclass(frozen=True)
class WorkerOptions:
    cpu_limit_s: int = 10  # per-case CPU budget enforced by the kernel (orphan guard; SIGXCPU kills)
    max_answer_chars: int = 512  # longer candidates are junk, not answers
    max_nesting: int = 32
    memory_limit_mb: int = 4096  # address space a worker may add on top of its warmed-up size (RLIMIT_AS)
    fault: str | None = field(default_factory=reward_fault)


def _parse(text: str) -> list:
    """math-verify parse without its signal.alarm timeout (the parent's deadline rules); errors raise."""
    from math_verify import parse

    return parse(text, parsing_timeout=None, raise_on_error=True)


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> list:
    """GRPO scores n samples per prompt against the same gold: parse it once (failures raise: not cached)."""
    parsed = _parse(gold)
    if not parsed:
        parsed = _parse(f"${gold}$")
    if not parsed:
        raise ValueError(f"math-verify found no expression in gold {gold[:80]!r}")
    return parsed


def verify_case(response: str, gold: str, opts: WorkerOptions) -> CaseResult:
    """Score one (already size-guarded) response against a gold string. Runs inside a worker only."""
    from math_verify import verify

    ext = extract_answer(response)
    if ext is None:
        return 0.0, False, "no_answer", None
    cand = ext.candidate
    shown = cand[:200]
    if len(cand) > opts.max_answer_chars:
        return 0.0, False, "answer_too_long", shown
    if max_brace_depth(cand) > opts.max_nesting:
        return 0.0, False, "too_nested", shown
    try:
        gold_parsed = _parse_gold(gold)
    except Exception as e:  # noqa: BLE001 - a bad gold is a data problem: say so, loudly
        return 0.0, False, f"error:unparsable_gold:{type(e).__name__}", shown
    try:
        # A boxed candidate is re-boxed so math-verify takes exactly that content; others are parsed as-is.
        pred = _parse(f"\\boxed{{{cand}}}" if ext.method == "boxed" else cand)
    except Exception as e:  # noqa: BLE001 - junk the model wrote: an ordinary wrong answer
        return 0.0, False, f"unparsable_answer:{type(e).__name__}", shown
    if not pred:
        return 0.0, False, "unparsable_answer", shown
    ok = verify(gold_parsed, pred, timeout_seconds=None)  # comparison errors read as "not equal"
    return (1.0, True, "correct", shown) if ok else (0.0, False, "wrong_answer", shown)


def set_cpu_deadline(seconds: int) -> None:
    """SIGXCPU after `seconds` more CPU time: a per-call limit in a long-lived worker (RLIMIT_CPU counts the
    process's whole life, so the soft limit moves with each call), never above the hard limit."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(used.ru_utime + used.ru_stime) + 1 + seconds
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard == resource.RLIM_INFINITY or soft <= hard:
        resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _guarded(response: str, gold: str, opts: WorkerOptions) -> CaseResult:
    set_cpu_deadline(opts.cpu_limit_s)
    try:
        if opts.fault:
            act_reward_fault(opts.fault)
        return verify_case(response, gold, opts)
    except MemoryError:
        return 0.0, False, MEMORY_LIMIT, None
    except RecursionError:
        return 0.0, False, "too_nested", None
    except Exception as e:  # noqa: BLE001 - any verifier bug scores 0 with its type, never kills the batch
        return 0.0, False, f"error:{type(e).__name__}", None


def serve_in_worker(conn: Any, warm_up: Callable[[], object], memory_limit_mb: int,
                    handle: Callable[..., CaseResult]) -> None:
    """The loop every sandboxed worker runs (verifiers and tools alike): pay lazy imports in `warm_up`, cap memory,
    announce ("ready", pid), then answer each (key, *payload) with ("result", key, handle(*payload)) until EOF/None.
    A process that hit its memory limit may hold half-built caches, so it exits and the pool starts a fresh one."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business; it closes us
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU must not write core files
    try:
        warm_up()
        limit_address_space(memory_limit_mb)
        conn.send(("ready", os.getpid()))
        while True:
            msg = conn.recv()
            if msg is None:
                break
            key, *payload = msg
            result = handle(*payload)
            conn.send(("result", key, result))
            if result[2] == MEMORY_LIMIT:
                break
    except (EOFError, BrokenPipeError, ConnectionResetError, KeyboardInterrupt):
        pass  # parent went away: exit quietly, never linger as an orphan
    finally:
        conn.close()


def worker_main(conn: Any, opts: WorkerOptions) -> None:
    """Entry point of a spawned reward worker: serves (idx, response, gold) -> CaseResult."""
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # "timeout disabled" notices: we time out
    serve_in_worker(conn, lambda: verify_case("\\boxed{1}", "1", opts),  # sympy/latex2sympy lazy imports
                    opts.memory_limit_mb, lambda response, gold: _guarded(response, gold, opts))
