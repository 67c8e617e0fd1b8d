"""A run directory's held-out curve: (x, metric) points from its eval.jsonl, on one of several x axes.

Each eval record is `{"step": update, "time": unix_s, "mean_at_k": ..., ...}`; runs that keep compute accounting
also carry `flops` (cumulative training + generation FLOPs) and `wallclock_s` (cumulative seconds since start).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class RunError(ValueError):
    """A run directory cannot be read as a curve; one line naming the file/row/field."""


@dataclass
class Curve:
    name: str
    x: np.ndarray  # ascending
    y: np.ndarray
    x_label: str


def _updates(rec: dict, first: dict) -> float | None:
    return rec.get("step")


def _hours(rec: dict, first: dict) -> float | None:
    if "wallclock_s" in rec:
        return rec["wallclock_s"] / 3600.0
    if "time" in rec and "time" in first:  # older runs: hours since the first (step-0) evaluation
        return (rec["time"] - first["time"]) / 3600.0
    return None


def _flops(rec: dict, first: dict) -> float | None:
    return rec.get("flops")


# x axis name -> (reader, axis label, field named in the error when missing)
X_AXES: dict[str, tuple[Callable[[dict, dict], float | None], str, str]] = {
    "updates": (_updates, "optimizer updates", "step"),
    "hours": (_hours, "wall-clock hours", "wallclock_s (or time)"),
    "flops": (_flops, "training + generation FLOPs", "flops"),
}


def eval_file(run: str | Path) -> Path:
    p = Path(run)
    f = p / "eval.jsonl" if p.is_dir() else p
    if not f.is_file():
        what = "no eval.jsonl in run directory" if p.is_dir() else "no such run directory or eval.jsonl file"
        raise RunError(f"{run}: {what}")
    return f


def read_records(path: Path) -> list[dict]:
    out = []
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise RunError(f"{path} line {i}: not JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise RunError(f"{path} line {i}: expected a JSON object")
        out.append(rec)
    return out


def load_curve(run: str | Path, x: str = "updates", metric: str = "mean_at_k") -> Curve:
    if x not in X_AXES:
        raise RunError(f"--x {x!r} unknown; choose one of {sorted(X_AXES)}")
    path = eval_file(run)
    recs = read_records(path)
    if not recs:
        raise RunError(f"{path}: no eval records")
    reader, label, field = X_AXES[x]
    xs, ys = [], []
    for i, rec in enumerate(recs, start=1):
        xv = reader(rec, recs[0])
        if xv is None:
            raise RunError(f"{path} line {i}: no {field!r} field for --x {x}"
                           + ("; this run predates compute accounting, use --x updates or hours" if x == "flops" else ""))
        if metric not in rec:
            keys = sorted(k for k, v in rec.items() if isinstance(v, (int, float)) and k not in ("step", "time"))
            raise RunError(f"{path} line {i}: no metric {metric!r}; available: {keys}")
        xs.append(float(xv))
        ys.append(float(rec[metric]))
    order = np.argsort(xs, kind="stable")
    name = Path(run).name if Path(run).is_dir() else Path(run).parent.name
    return Curve(name or str(run), np.asarray(xs)[order], np.asarray(ys)[order], label)
