"""scripts/suite_durations.py: per-directory and per-file sums of pytest's --durations lines."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

OUTPUT = """\
============================== slowest durations ===============================
40.50s call     tests/e2e/test_a.py::test_x[tp2]
12.25s setup    tests/e2e/test_b.py::test_y
7.25s call     tests/convert/test_c.py::test_z
0.75s teardown tests/e2e/test_a.py::test_x[tp2]
(12 durations < 0.005s hidden.)
1 failed, 9 passed, 2 deselected in 70.00s (0:01:10)
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "suite_durations.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_sums_per_directory_and_file(tmp_path):
    out = tmp_path / "suite.txt"
    out.write_text(OUTPUT)
    proc = _run(str(out), "--top", "2")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "4 phases listed, 61 s"
    assert lines[1] == "pytest: 1 failed, 9 passed, 2 deselected in 70.00s (0:01:10)"
    assert "       54  88.1%  e2e" in lines and "        7  11.9%  convert" in lines
    assert "       41  tests/e2e/test_a.py" in lines  # call + teardown of the same test
    slowest = lines[lines.index("slowest phases, top 2 (s):") + 1 :]
    assert slowest == [
        "     40.5  call     tests/e2e/test_a.py::test_x[tp2]",
        "     12.2  setup    tests/e2e/test_b.py::test_y",
    ]


def test_output_without_durations_is_exit_2(tmp_path):
    out = tmp_path / "plain.txt"
    out.write_text("10 passed in 3.00s\n")
    proc = _run(str(out))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"suite_durations: {out}: no duration lines: run pytest with --durations=0"
