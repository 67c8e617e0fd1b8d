"""Scratch folders for benchmarks, removed when the benchmark exits.

A benchmark writes real run directories (checkpoints, weight-sync versions, HF folders: ~0.5-2 GB each for
SmolLM2). Left in /tmp, a few benchmark runs fill a CI machine's disk; the numbers a benchmark reports are
printed, so its folders are scratch. MCORE_RL_KEEP_SCRATCH=1 keeps them (printed at exit) for inspection.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path


def scratch_dir(prefix: str, parent: str | Path | None = None) -> Path:
    """A fresh folder that is deleted at interpreter exit (normal exit or an uncaught exception)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    if os.environ.get("MCORE_RL_KEEP_SCRATCH") == "1":
        atexit.register(lambda: print(f"kept scratch folder {path}", file=sys.stderr))
    else:
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
