"""Run several `mcore-rl-convert` commands in one interpreter: `python -m tests.convert.cli_batch CALLS.json`.

Why: a conversion CLI process spends ~6 s of CPU importing torch, Megatron and transformers and ~1 s on a tiny
model's work, so checks that each need their own command (a family's conversion, then its logits check) share
one start-up here. Each command goes through the CLI's own `main(argv)` (argument parsing, exit codes, the
one-line errors) exactly as `mcore-rl-convert` runs it; the single-rank jobs run inline and tear their process
group down after each command (convert/launch.py), multi-rank ones spawn their ranks as usual.

CALLS.json holds a list of argv lists; the results (exit code, stdout, stderr per command) are written as JSON to
CALLS.json + ".out".
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path


def run_calls(calls: list[list[str]]) -> list[dict]:
    from mcore_rl.convert.cli import main

    results = []
    for argv in calls:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as e:  # argparse errors exit as the CLI would
                rc = e.code if isinstance(e.code, int) else 1
        results.append({"argv": argv, "rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()})
    return results


if __name__ == "__main__":
    path = Path(sys.argv[1])
    path.with_name(path.name + ".out").write_text(json.dumps(run_calls(json.loads(path.read_text()))))
