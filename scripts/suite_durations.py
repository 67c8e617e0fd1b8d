"""Where the default suite's time goes, from the output of `pytest --durations=0`.

    bash scripts/test.sh --durations=0 -p no:randomly > /tmp/suite.txt 2>&1
    python scripts/suite_durations.py /tmp/suite.txt [--top 40]

Prints seconds per test directory and per file (setup + call + teardown summed) and the slowest test phases, so
a change to fixtures or `slow` marks can be judged by the directories it moves. Timings on a shared machine scale
with its load: compare runs made under the same load, or the shares, not the raw seconds.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

LINE = re.compile(r"^\s*(?P<s>[\d.]+)s (?P<phase>call|setup|teardown)\s+(?P<node>tests/\S+)")
SUMMARY = re.compile(r"^=*\s*(?P<text>.*\bin (?P<s>[\d.]+)s\b.*?)\s*=*$")


def parse(text: str) -> list[tuple[float, str, str]]:
    """(seconds, phase, node id) for every duration line pytest printed."""
    return [(float(m["s"]), m["phase"], m["node"]) for m in map(LINE.match, text.splitlines()) if m]


def per_key(rows: list[tuple[float, str, str]], key) -> Counter:
    out: Counter = Counter()
    for s, _, node in rows:
        out[key(node)] += s
    return out


def report(text: str, top: int = 30) -> str:
    rows = parse(text)
    if not rows:
        raise ValueError("no duration lines: run pytest with --durations=0")
    listed = sum(s for s, _, _ in rows)
    lines = [f"{len(rows)} phases listed, {listed:.0f} s"]
    summary = [m for m in map(SUMMARY.match, text.splitlines()[-3:]) if m]
    if summary:
        lines.append(f"pytest: {summary[-1]['text']}")
    lines.append("\nper directory (s):")
    for d, s in per_key(rows, lambda n: n.split("/")[1]).most_common():
        lines.append(f"  {s:7.0f}  {100 * s / listed:4.1f}%  {d}")
    lines.append(f"\nper file, top {top} (s):")
    for f, s in per_key(rows, lambda n: n.split("::")[0]).most_common(top):
        lines.append(f"  {s:7.0f}  {f}")
    lines.append(f"\nslowest phases, top {top} (s):")
    for s, phase, node in sorted(rows, reverse=True)[:top]:
        lines.append(f"  {s:7.1f}  {phase:8s} {node}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("output", type=Path, help="pytest's output, run with --durations=0")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args(argv)
    try:
        print(report(a.output.read_text(errors="replace"), a.top))
    except (OSError, ValueError) as e:
        print(f"suite_durations: {a.output}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
