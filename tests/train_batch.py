"""Run several `mcore-rl-train` command lines in one interpreter: `python -m tests.train_batch CALLS.json`.

Why: a tiny CLI run spends ~6 s of CPU importing torch, Megatron and transformers and ~2 s waiting for its
reward pool's forkserver to start, about half the run. Tests whose runs need no process of their own (no
signal, no environment variable, no timing) hand their command lines to `run_train_batch` (tests/conftest.py),
which runs them here one after another, as a Hydra multirun runs its jobs: each goes through the CLI's own
`main()` (composition, one-line config errors and their exit codes), builds its run and tears it down. Each
run's stdout and stderr are captured at the file-descriptor level (library and child output included).

CALLS.json holds a list of argv lists (overrides only); results (exit code, stdout, stderr, seconds) are written
as JSON to CALLS.json + ".out".
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path


def _run_one(argv: list[str]) -> dict:
    from mcore_rl.train import main

    sys.stdout.flush()
    sys.stderr.flush()
    environ = dict(os.environ)  # the CLI sets variables for its own process (HYDRA_FULL_ERROR): not for the next
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.argv = ["mcore-rl-train", *argv]
        t0 = time.time()
        try:
            main()
            rc = 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - a traceback is what the CLI would print; exit 1 like Python
            import traceback

            traceback.print_exc()
            rc = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.environ.clear()
            os.environ.update(environ)
        out.seek(0)
        err.seek(0)
        return {"argv": argv, "rc": rc, "stdout": out.read(), "stderr": err.read(), "seconds": time.time() - t0}


if __name__ == "__main__":
    path = Path(sys.argv[1])
    results = [_run_one(argv) for argv in json.loads(path.read_text())]
    path.with_name(path.name + ".out").write_text(json.dumps(results))
