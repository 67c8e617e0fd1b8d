"""The error a run cannot survive, and the one yes/no all ranks must agree on before acting on it.

Why: a fault (non-finite loss on one rank, a full disk under one rank's shard, a reward pool that keeps crashing)
must turn into the same decision on every rank, or the ranks diverge into a collective that never completes (a
hang until `trainer.dist_timeout_s`). The agreement itself is `distributed.all_ranks_any` (one MAX all-reduce on
the gloo world group): `distributed.py` stays the one place that knows backends and devices.
"""

from __future__ import annotations

from mcore_rl.distributed import all_ranks_any as any_rank

__all__ = ["FatalRunError", "any_rank"]


class FatalRunError(RuntimeError):
    """A run cannot go on (too many non-finite updates, a failed checkpoint save, a reward that keeps crashing):
    the entry point prints its message as one line and exits non-zero."""
