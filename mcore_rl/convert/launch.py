"""Run a per-rank function as a local TP*PP job: in this process for one rank, else in spawned processes.

Why spawn instead of asking for torchrun: a conversion is one command on one machine; each rank holds only its own
shard, so a model larger than one process's share of RAM still converts. A failing rank takes the others down
(torch.multiprocessing terminates the rest) and its error comes back as one line.
"""

from __future__ import annotations

import os
import re
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from mcore_rl.convert.common import ConvertError

_EXC_PREFIX = re.compile(r"^[\w.]*(Error|Exception|Interrupt): ")


def quiet_megatron_warnings() -> None:
    """Megatron warns on every import that Apex/TE are absent; on a CPU conversion that is expected noise."""
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning)


@contextmanager
def _single_rank_env() -> Iterator[None]:
    from mcore_rl.distributed import free_port

    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _finish() -> None:
    from mcore_rl.distributed import destroy_distributed

    destroy_distributed()


def _child(local_rank: int, world: int, port: int, fn: Callable[[Any], None], payload: Any) -> None:
    quiet_megatron_warnings()
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
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


def run_ranks(fn: Callable[[Any], None], payload: Any, world: int) -> None:
    """Call `fn(payload)` on `world` ranks (module-level fn, picklable payload); re-raise a rank's error."""
    if world == 1:
        quiet_megatron_warnings()
        with _single_rank_env():
            try:
                fn(payload)
            except (KeyboardInterrupt, SystemExit, ConvertError):
                raise
            except BaseException as e:
                raise ConvertError(f"rank 0: {one_line(str(e))}", detail=traceback.format_exc()) from e
            finally:
                _finish()
        return
    import torch.multiprocessing as mp

    from mcore_rl.distributed import free_port

    try:
        mp.start_processes(_child, args=(world, free_port(), fn, payload), nprocs=world, join=True,
                           start_method="spawn")
    except mp.ProcessRaisedException as e:
        raise ConvertError(f"rank {e.error_index}: {one_line(e.msg)}", detail=e.msg) from None
    except mp.ProcessExitedException as e:
        raise ConvertError(
            f"rank {e.error_index} died (exit code {e.exit_code}{', signal ' + e.signal_name if e.signal_name else ''}"
            "); out of memory? try more TP/PP ranks or a machine with more RAM"
        ) from None
