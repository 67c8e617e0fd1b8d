"""`function` reward: a scoring function from the user's own code, run in the sandboxed worker pool.

`reward=function reward.function.path=my_pkg.rewards:score` calls `score(response, answer, record)` once per sample
(or, with `batched: true`, `score(responses, answers, records)` once per `batch_size` samples); `record` is the
sample's prompt record as a plain dict. It returns a number, or a dict with a `score` (and optionally `correct`)
whose other numeric entries are logged as `reward/<key>` means. `async def` works: the worker awaits it.

Why worker processes: user code may hang, leak, allocate without bound or exit the interpreter, and the trainer
must outlive all of it. The function is imported by its `module:attr` path inside each worker (multiprocessing
starts every worker with the parent's `sys.path` of that moment, forkserver included, so what the trainer can import
a worker can too), each call runs under the pool's hard
deadline and the worker's memory (RLIMIT_AS) and CPU limits, and whatever goes wrong scores that call's samples 0
with a reason the trainer counts: timeout, worker_crash, memory_limit, error:<exception type>, invalid:<what came
back> (NaN, inf, a string, None, a dict without `score`, a batch of the wrong length). One warning line per call of
`score` names the failures; the rest of the batch is scored as usual. The parent imports the function once too
(`check_reward`, before any model is built), so a wrong path fails at start-up with one line.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import multiprocessing as mp
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mcore_rl.rewards.base import RewardResult, check_lengths, finite_number
from mcore_rl.rewards.pool import VerifierPool, _preload_modules
from mcore_rl.rewards.registry import register_reward
from mcore_rl.rewards.worker import MEMORY_LIMIT, serve_in_worker, set_cpu_deadline
from mcore_rl.utils import config_from_dict

logger = logging.getLogger(__name__)
OK = "ok"  # the reason of a sample the function scored


@dataclass
class FunctionRewardConfig:
    path: str | None = None  # "package.module:function" (attr may be dotted: "mod:Class.method"); importable
    batched: bool = False  # True: the function takes lists (responses, answers, records) and returns a list
    batch_size: int = 64  # batched: samples per call
    num_workers: int = 2  # worker processes (calls run in parallel across them)
    timeout_s: float = 10.0  # hard deadline per call (one sample, or one batch); the worker is killed past it
    memory_limit_mb: int = 2048  # address space a worker may add (RLIMIT_AS); past it: 0, "memory_limit"
    mp_context: str = "forkserver"  # or spawn; never fork (the trainer holds torch/gloo threads)
    startup_timeout_s: float = 120.0  # a worker must have imported the function by then

    def __post_init__(self) -> None:
        for key in ("batch_size", "num_workers", "timeout_s", "startup_timeout_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"reward.function.{key}={getattr(self, key)!r} must be > 0")
        if self.memory_limit_mb < 0:
            raise ValueError(f"reward.function.memory_limit_mb={self.memory_limit_mb} must be >= 0 (0 = no limit)")


def load_function(path: str) -> Callable[..., Any]:
    """`module:attr` -> the callable; ValueError with one line saying what failed (runs the module's code)."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError("expected 'module:function', e.g. my_pkg.rewards:score")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"cannot import module {module!r} ({type(e).__name__}: {e})") from None
    except Exception as e:  # noqa: BLE001 - the module's own code raised: say so in one line
        raise ValueError(f"importing {module!r} raised {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{attr!r} in {module!r} is a {type(obj).__name__}, not a function")
    return obj


def check_function(cfg: FunctionRewardConfig, where: str = "reward.function") -> Callable[..., Any]:
    """The parent's cheap check: the path is set, imports, and names something that takes three arguments."""
    if not cfg.path:
        raise ValueError(f"{where}.path is not set: give module:function, e.g. {where}.path=my_pkg.rewards:score")
    try:
        fn = load_function(cfg.path)
    except ValueError as e:
        raise ValueError(f"{where}.path={cfg.path!r}: {e}") from None
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # a builtin or C function: nothing to read
    try:
        sig.bind(None, None, None)
    except TypeError:
        args = "(responses, answers, records)" if cfg.batched else "(response, answer, record)"
        raise ValueError(f"{where}.path={cfg.path!r}: must take {args}; its signature is {sig}") from None
    return fn


def to_result(value: Any) -> tuple[float, bool, str, dict[str, float]]:
    """What the function returned -> (score, correct, reason, extra metrics). `correct`: the dict's own `correct`,
    else full marks (score >= 1). Extra entries that are not finite numbers are not logged."""
    correct, metrics = None, {}
    if isinstance(value, Mapping):
        if "score" not in value:
            return 0.0, False, "invalid:no_score", {}
        for k, v in value.items():
            if k not in ("score", "correct") and isinstance(k, str) and isinstance(finite_number(v), float):
                metrics[k] = float(v)
        correct, value = value.get("correct"), value["score"]
    score = finite_number(value)
    if isinstance(score, str):
        return 0.0, False, score, metrics
    return score, bool(correct) if correct is not None else score >= 1.0, OK, metrics


@dataclass(frozen=True)
class FunctionWorkerOptions:
    path: str
    batched: bool
    cpu_limit_s: int
    memory_limit_mb: int


def function_worker_main(conn: Any, opts: FunctionWorkerOptions) -> None:
    """Worker entry: import the function, then answer each call. A result is (score, correct, reason, None,
    extra) with extra = the metrics dict (one sample) or the list of per-sample tuples (a batch); a failed call is
    (0.0, False, reason, None), like the pool's own timeout and crash results."""
    state: dict[str, Any] = {}

    def load() -> None:
        state["fn"] = load_function(opts.path)

    def call(*payload: Any) -> tuple:
        set_cpu_deadline(opts.cpu_limit_s)
        try:
            out = state["fn"](*payload)
            if inspect.isawaitable(out):  # async def: one event loop per worker, kept (clients may cache it)
                out = state.setdefault("loop", asyncio.new_event_loop()).run_until_complete(out)
            if not opts.batched:
                score, correct, reason, metrics = to_result(out)
                return score, correct, reason, None, metrics
            if not isinstance(out, (list, tuple)):
                return 0.0, False, f"invalid:batch_{type(out).__name__}", None
            if len(out) != len(payload[0]):
                return 0.0, False, "invalid:batch_length", None
            return 0.0, True, OK, None, [to_result(v) for v in out]
        except MemoryError:
            return 0.0, False, MEMORY_LIMIT, None
        except Exception as e:  # noqa: BLE001 - a bug in the user's function scores 0 with its type
            return 0.0, False, f"error:{type(e).__name__}", None

    serve_in_worker(conn, load, opts.memory_limit_mb, call)


class FunctionReward:
    """The user's function in a `VerifierPool`; see the module docstring for what it may return and what happens
    when it fails."""

    def __init__(self, cfg: FunctionRewardConfig, where: str = "reward.function") -> None:
        self.cfg = cfg
        self.is_async = inspect.iscoroutinefunction(check_function(cfg, where))
        opts = FunctionWorkerOptions(cfg.path or "", cfg.batched, int(cfg.timeout_s) + 5, cfg.memory_limit_mb)
        if cfg.mp_context == "forkserver":
            # Read only when the process's forkserver first starts: workers then fork with this module imported.
            mp.get_context("forkserver").set_forkserver_preload([*_preload_modules(), __name__])
        self.pool = VerifierPool(num_workers=cfg.num_workers, timeout_s=cfg.timeout_s, mp_context=cfg.mp_context,
                                 startup_timeout_s=cfg.startup_timeout_s, options=opts, target=function_worker_main,
                                 log_level=logging.DEBUG)  # one summary line per batch instead (_log_failures)

    def score(self, responses: list[str], answers: list[str], records: list[dict] | None = None
              ) -> list[RewardResult]:
        check_lengths(responses, answers, records)
        if records is None:
            records = [{"prompt_id": None, "prompt": None, "answer": a, "metadata": {}} for a in answers]
        results = (self._batched if self.cfg.batched else self._per_sample)(responses, answers, records)
        self._log_failures(results)
        return results

    def _per_sample(self, responses: list, answers: list, records: list[dict]) -> list[RewardResult]:
        out = []
        for res, latency in self.pool.map(list(zip(responses, answers, records))) if responses else []:
            extra = res[4] if len(res) > 4 else {}
            out.append(RewardResult(float(res[0]), bool(res[1]), res[2], None, latency, extra or {}))
        return out

    def _batched(self, responses: list, answers: list, records: list[dict]) -> list[RewardResult]:
        n = self.cfg.batch_size
        spans = [(i, min(i + n, len(responses))) for i in range(0, len(responses), n)]
        calls = [(responses[a:b], answers[a:b], records[a:b]) for a, b in spans]
        out: list[RewardResult] = []
        for (a, b), (res, latency) in zip(spans, self.pool.map(calls) if calls else []):
            if res[2] == OK and len(res) > 4:
                out += [RewardResult(s, c, r, None, latency, m) for s, c, r, m in res[4]]
            else:  # the whole call failed: each of its samples carries the reason
                out += [RewardResult(0.0, False, res[2], None, latency) for _ in range(b - a)]
        return out

    def _log_failures(self, results: list[RewardResult]) -> None:
        bad = Counter(r.reason for r in results if r.reason != OK)
        if bad:
            logger.warning("reward function %s: %d of %d samples scored 0 by a failure (%s)", self.cfg.path,
                           sum(bad.values()), len(results), ", ".join(f"{k}={v}" for k, v in sorted(bad.items())))

    def describe(self) -> str:
        c = self.cfg
        mode = f"batched, batch_size={c.batch_size}" if c.batched else "per sample"
        return (f"function {c.path} ({mode}{', async' if self.is_async else ''}; num_workers={c.num_workers}, "
                f"timeout_s={c.timeout_s:g} per call, memory_limit_mb={c.memory_limit_mb}, mp_context={c.mp_context})")

    def close(self) -> None:
        self.pool.close()


@register_reward("function", FunctionRewardConfig, check=check_function)
def build_function(options: dict[str, Any]) -> FunctionReward:
    return FunctionReward(config_from_dict(FunctionRewardConfig, options, "reward.function"))
