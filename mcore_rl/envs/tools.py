"""Tools run in the sandboxed worker pool of the rewards (`VerifierPool`): hard per-call deadline, memory limit,
crash counting, a worker killed and replaced on a hang, never the trainer's process.

The worker speaks the pool's small protocol (announce ("ready", pid), answer each (key, name, arguments_json) with
("result", key, (0.0, ok, reason, text))); the pool turns a passed deadline into reason "timeout" and a dead worker
into "worker_crash". Whatever happens, the model gets one line of text back: a tool result or `Error: ...`.
"""

from __future__ import annotations

import importlib
import json
import logging
import multiprocessing as mp
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mcore_rl.envs.base import Tool
from mcore_rl.envs.tool_calls import ToolCall, check_arguments
from mcore_rl.rewards.pool import VerifierPool, _preload_modules
from mcore_rl.rewards.worker import MEMORY_LIMIT, serve_in_worker, set_cpu_deadline

logger = logging.getLogger(__name__)
MAX_RESULT_CHARS = 2000  # a tool result longer than this is cut (it becomes prompt tokens of the next turn)


@dataclass(frozen=True)
class ToolWorkerOptions:
    functions: dict[str, str]  # tool name -> "module:function"
    cpu_limit_s: int = 10
    memory_limit_mb: int = 512
    fault: str | None = None  # tests: "crash" kills the worker on every call


def _run_one(fn: Any, args_json: str) -> tuple[float, bool, str, str]:
    try:
        out = fn(**json.loads(args_json))
    except MemoryError:
        return 0.0, False, MEMORY_LIMIT, "Error: the tool ran out of memory"
    except ValueError as e:  # the tool's own refusal (bad input): its message is for the model
        return 0.0, False, "tool_error", f"Error: {str(e)[:200]}"
    except Exception as e:  # noqa: BLE001 - a tool bug is a message to the model, never a dead batch
        return 0.0, False, f"error:{type(e).__name__}", f"Error: {type(e).__name__}: {str(e)[:200]}"
    text = out if isinstance(out, str) else json.dumps(out)
    return 0.0, True, "ok", text[:MAX_RESULT_CHARS]


def tool_worker_main(conn: Any, opts: ToolWorkerOptions) -> None:
    """Spawned tool worker: import the tool functions, then serve (name, arguments_json) calls in the rewards'
    sandboxed loop (same memory cap, per-call CPU deadline and exit-after-MemoryError as the verifiers)."""
    fns: dict[str, Any] = {}

    def load() -> None:
        for name, path in opts.functions.items():
            module, _, attr = path.partition(":")
            fns[name] = getattr(importlib.import_module(module), attr)

    def call(name: str, args_json: str) -> tuple[float, bool, str, str]:
        if opts.fault == "crash":
            os._exit(3)
        set_cpu_deadline(opts.cpu_limit_s)
        return _run_one(fns[name], args_json)

    serve_in_worker(conn, load, opts.memory_limit_mb, call)


@dataclass
class ToolResult:
    call: ToolCall
    text: str  # what the model sees
    ok: bool
    reason: str  # ok | malformed | unknown_tool | too_many_calls | tool_error | timeout | worker_crash |
    #              memory_limit | error:<exception type>


def tool_message(result: ToolResult) -> dict[str, Any]:
    """The message a tool result becomes in the conversation (the runner's, and a scripted solver's replay)."""
    return {"role": "tool", "name": result.call.name or "invalid", "content": result.text}


@dataclass
class ToolStats:
    reasons: Counter = field(default_factory=Counter)

    def as_metrics(self) -> dict[str, float]:
        return {f"env/tool_{k}": float(v) for k, v in sorted(self.reasons.items())}


class ToolRunner:
    """Runs batches of parsed calls against an environment's tools in one pool (calls of many episodes at once)."""

    def __init__(
        self,
        tools: Sequence[Tool],
        *,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        memory_limit_mb: int = 512,
        mp_context: str = "forkserver",
        fault: str | None = None,
    ) -> None:
        self.tools = {t.name: t for t in tools}
        opts = ToolWorkerOptions(
            {t.name: t.function for t in tools},
            cpu_limit_s=int(timeout_s) + 5,
            memory_limit_mb=memory_limit_mb,
            fault=fault,
        )
        self.timeout_s = timeout_s
        if mp_context == "forkserver":
            # Read only when the process's forkserver first starts: workers then fork with this module imported
            # (the reward pool's warm modules kept), instead of importing it once per (re)started worker.
            mp.get_context("forkserver").set_forkserver_preload([*_preload_modules(), __name__])
        self.pool = VerifierPool(
            num_workers=num_workers,
            timeout_s=timeout_s,
            mp_context=mp_context,
            options=opts,
            target=tool_worker_main,
        )
        self.stats = ToolStats()

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """One result per call, in order. Malformed / unknown calls are answered here without a worker."""
        results: list[ToolResult | None] = [None] * len(calls)
        todo, cases = [], []
        for i, call in enumerate(calls):
            tool = self.tools.get(call.name)
            if call.valid and tool is None:
                results[i] = ToolResult(
                    call,
                    f"Error: unknown tool {call.name!r}; available: {', '.join(sorted(self.tools))}",
                    False,
                    "unknown_tool",
                )
                continue
            checked = check_arguments(call, tool.parameters) if tool is not None else call
            if not checked.valid:
                results[i] = ToolResult(
                    checked, f"Error: malformed tool call: {checked.error}", False, "malformed"
                )
                continue
            todo.append(i)
            cases.append((call.name, json.dumps(call.arguments)))
        for i, ((_, ok, reason, text), _lat) in zip(todo, self.pool.map(cases) if cases else []):
            if reason == "timeout":
                text = f"Error: the tool did not answer within {self.timeout_s:g}s"
            elif reason == "worker_crash":
                text = "Error: the tool crashed"
            results[i] = ToolResult(calls[i], text or "", ok, reason)
        for r in results:
            self.stats.reasons[r.reason] += 1  # type: ignore[union-attr]
        return results  # type: ignore[return-value]

    @staticmethod
    def refused(call: ToolCall, limit: int) -> ToolResult:
        """The answer to a call beyond `max_tool_calls_per_turn`."""
        return ToolResult(call, f"Error: at most {limit} tool calls per turn", False, "too_many_calls")

    def close(self) -> None:
        self.pool.close()
