"""Run a per-rank function as a local TP*PP job: in this process for one rank, else in spawned processes.

Why spawn instead of asking for torchrun: a conversion is one command on one machine; each rank holds only its own
shard, so a model larger than one process's share of RAM still converts. A failing rank takes the others down
(torch.multiprocessing terminates the rest) and its error comes back as one line.
"""

from __future__ import annotations

import datetime
import os
import re
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mcore_rl.convert.common import ConvertError

_EXC_PREFIX = re.compile(r"^[\w.]*(Error|Exception|Interrupt): ")


def quiet_megatron_warnings() -> None:
    """Megatron warns on every import that Apex/TE are absent; on a CPU conversion that is expected noise."""
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning)


@contextmanager
def _rank_env(rank: int, world: int) -> Iterator[None]:
    """The torchrun-style variables `init_distributed` reads, restored afterwards (matters in-process)."""
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _init_process_group(rank: int, world: int, store_file: str) -> None:
    """Rendezvous through a file, not a TCP port: no port can be stolen between choosing and binding it."""
    import torch
    import torch.distributed as dist

    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = "nccl"
    dist.init_process_group(backend, init_method=f"file://{store_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=1800))


def _finish() -> None:
    from mcore_rl.distributed import destroy_distributed

    destroy_distributed()


def _child(rank: int, world: int, store_file: str, fn: Callable[[Any], None], payload: Any) -> None:
    quiet_megatron_warnings()
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        with _rank_env(rank, world):
            _init_process_group(rank, world, store_file)
            fn(payload)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException, which spawn would not report
        raise RuntimeError(one_line(str(e))) from e
    finally:
        _finish()


def one_line(text: str) -> str:
    """Last line of a child's traceback, without the exception class prefix."""
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else str(text)
    return _EXC_PREFIX.sub("", last)


def run_ranks(fn: Callable[[Any], None], payload: Any, world: int, scratch: Path | None = None) -> None:
    """Call `fn(payload)` on `world` ranks (module-level fn, picklable payload); re-raise a rank's error.

    The rendezvous file lives in `scratch` when given (a directory the caller sweeps even after a SIGKILL),
    else in a temporary directory.
    """
    if scratch is not None:
        scratch.mkdir(parents=True, exist_ok=False)
    with tempfile.TemporaryDirectory(prefix="mcore-rl-convert-", dir=scratch) as tmp:
        store_file = os.path.join(tmp, "rendezvous")
        if world == 1:
            _run_inline(fn, payload, store_file)
        else:
            _run_spawned(fn, payload, world, store_file)
    if scratch is not None:
        scratch.rmdir()


def _run_inline(fn: Callable[[Any], None], payload: Any, store_file: str) -> None:
    quiet_megatron_warnings()
    try:
        with _rank_env(0, 1):
            _init_process_group(0, 1, store_file)
            fn(payload)
    except (KeyboardInterrupt, SystemExit, ConvertError):
        raise
    except BaseException as e:
        raise ConvertError(f"rank 0: {one_line(str(e))}", detail=traceback.format_exc()) from e
    finally:
        _finish()


def _run_spawned(fn: Callable[[Any], None], payload: Any, world: int, store_file: str) -> None:
    import torch.multiprocessing as mp

    try:
        mp.start_processes(_child, args=(world, store_file, fn, payload), nprocs=world, join=True,
                           start_method="spawn")
    except mp.ProcessRaisedException as e:
        raise ConvertError(f"rank {e.error_index}: {one_line(e.msg)}", detail=e.msg) from None
    except mp.ProcessExitedException as e:
        how = f"signal {e.signal_name}" if e.signal_name else f"exit code {e.exit_code}"
        hint = "; out of memory? use more TP/PP ranks or a machine with more RAM" if e.signal_name == "SIGKILL" else ""
        raise ConvertError(f"rank {e.error_index} died ({how}){hint}") from None
