"""The one place that neutralises Megatron-Core's CUDA assumptions so real TP/PP/DP code runs on CPU with gloo.

Applied only when CUDA is unavailable (`apply()` is a no-op otherwise). Every interception is recorded with the
Megatron call site (file:line) in `HITS`, so a test can show exactly which upstream sites we paper over and a new
Megatron release that adds one shows up as a diff rather than a mystery.

What is neutralised (see ../shared/docs/ENVIRONMENT.md for the 0.16.1 line numbers):
1. `torch.cuda.current_device()` used as an allocation device -> "cpu".
2. streams, events, synchronize, nvtx, empty_cache -> no-ops / CPU stand-ins.
3. the CUDA RNG state tracker -> a CPU tracker with the same interface (forked CPU generator states).
4. hard-coded `device="cuda"` / `.cuda()` -> CPU, via a TorchFunctionMode; and `tensor.type()` string checks made
   from inside Megatron (e.g. `== 'torch.cuda.FloatTensor'`) see the CUDA spelling of the CPU tensor type.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

HITS: Counter[str] = Counter()
_APPLIED = False
_MODE: TorchFunctionMode | None = None
_SEP = os.sep


def _megatron_site(depth: int = 2) -> str | None:
    """file:line of the nearest Megatron frame on the stack (None if Megatron is not the caller)."""
    f = sys._getframe(depth)
    for _ in range(12):
        if f is None:
            return None
        fn = f.f_code.co_filename
        i = fn.find(f"{_SEP}megatron{_SEP}core{_SEP}")
        if i >= 0:
            return f"megatron/core/{fn[i + 15:]}:{f.f_lineno}"
        f = f.f_back
    return None


def _record(kind: str, depth: int = 3) -> str | None:
    site = _megatron_site(depth)
    HITS[f"{kind} @ {site or 'non-megatron'}"] += 1
    return site


def _is_cuda(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, int) and not isinstance(dev, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA device arguments to CPU and answers Megatron's `.type()` checks with the CUDA spelling."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            _record("tensor.cuda()")
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            t = func(*args)
            if t.startswith("torch.") and not t.startswith("torch.cuda.") and _megatron_site(2):
                _record("tensor.type()")
                return "torch.cuda." + t[len("torch."):]
            return t
        dev = kwargs.get("device")
        if dev is not None and _is_cuda(dev):
            _record(f"device=cuda in {getattr(func, '__name__', func)}")
            kwargs = {**kwargs, "device": "cpu"}
        elif func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            _record("tensor.to(cuda)")
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _CpuStream:
    """Stand-in for torch.cuda.Stream/Event: every operation is already synchronous on CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str):
        return lambda *a, **k: None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _install_cuda_module_patches() -> None:
    cuda = torch.cuda

    def current_device() -> str:
        _record("torch.cuda.current_device")
        return "cpu"

    def noop(name: str):
        def fn(*args: Any, **kwargs: Any) -> None:
            _record(f"torch.cuda.{name}")

        return fn

    def stream(*args: Any, **kwargs: Any):
        _record("torch.cuda.stream")
        return contextlib.nullcontext()

    def default_stream(*args: Any, **kwargs: Any):
        _record("torch.cuda.default_stream")
        return _CpuStream()

    cuda.current_device = current_device
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        setattr(cuda, name, noop(name))
    cuda.stream = stream
    cuda.default_stream = default_stream
    cuda.current_stream = default_stream
    cuda.Stream = _CpuStream
    cuda.Event = _CpuStream
    cuda.nvtx.range_push = noop("nvtx.range_push")
    cuda.nvtx.range_pop = noop("nvtx.range_pop")
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0


def _install_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    base = mrandom.CudaRNGStatesTracker

    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """Same interface as Megatron's tracker; named states are CPU generator states."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            g = torch.Generator()
            g.manual_seed(seed)
            self.states_[name] = g.get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            _record("rng_tracker.fork", depth=4)
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    tracker = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    orig_init = mrandom.initialize_rng_tracker

    def initialize_rng_tracker(*args: Any, force_reset: bool = False, **kwargs: Any) -> None:
        _record("initialize_rng_tracker")
        if force_reset:
            tracker.reset()
        mrandom._CUDA_RNG_STATE_TRACKER = tracker
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    initialize_rng_tracker.__wrapped__ = orig_init  # type: ignore[attr-defined]
    mrandom.initialize_rng_tracker = initialize_rng_tracker


def apply() -> bool:
    """Install the shim once, only on machines without CUDA. Returns True when it is active."""
    global _APPLIED, _MODE
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    _install_cuda_module_patches()
    _install_rng_tracker()
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    _APPLIED = True
    return True
