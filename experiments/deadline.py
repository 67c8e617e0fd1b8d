"""Whether a queued run can finish before the queue's deadline (`--until`, `UNTIL=` for queue.sh).

Why: the queue shares its machine with other work that needs it quiet at known times (a timing, a test suite, the
end of a working session). A run cut off there costs its updates since the last checkpoint, and, if its process is
killed rather than stopped, its segment's wall-clock and CPU record. So before each run the queue estimates its
wall-clock from what the experiment's finished runs took and stops cleanly (exit as after `queue.sh --stop`) when
the run would end past the deadline; rerunning the queue later resumes at that run.

The estimate: seconds per update over every segment of the same arm's finished seeds (start-up and held-out evals
included, as they are in a run), times the updates left after the run's checkpoint, times MARGIN; an arm with no
finished seed uses the mean over the experiment's finished arms; an experiment with none has no estimate, and the
run starts.
"""

from __future__ import annotations

import datetime as dt
import json
import statistics
import time
from pathlib import Path

from plan import MARKER, RunState

MARGIN = 1.15  # finished seeds of one arm took within ~15% of each other on one machine (load varies)


def parse_until(text: str, now: float | None = None) -> float:
    """`HH:MM` (UTC: the next such time from now) or `YYYY-MM-DDTHH:MM` (UTC) -> epoch seconds."""
    now = time.time() if now is None else now
    try:
        if "T" in text:
            return dt.datetime.fromisoformat(text).replace(tzinfo=dt.UTC).timestamp()
        hh, mm = (int(x) for x in text.split(":"))
        base = dt.datetime.fromtimestamp(now, dt.UTC)
        at = base.replace(hour=hh, minute=mm, second=0, microsecond=0)
    except ValueError:
        raise SystemExit(f"--until: expected HH:MM or YYYY-MM-DDTHH:MM (UTC), got {text!r}") from None
    return (at + dt.timedelta(days=1)).timestamp() if at.timestamp() <= now else at.timestamp()


def _per_update(arm_dir: Path) -> list[float]:
    """Wall-clock seconds per update of each finished seed (all its segments) under one arm's data/ folder."""
    out = []
    for marker in sorted(arm_dir.glob(f"seed*.{MARKER}")):
        meta = arm_dir / marker.name.replace(MARKER, "arm.json")
        if not meta.is_file():
            continue
        steps = json.loads(marker.read_text())["steps"]
        wall = sum(s["wall_s"] for s in json.loads(meta.read_text())["segments"])
        if steps > 0 and wall > 0:
            out.append(wall / steps)
    return out


def estimate_s(exp_dir: Path, arm: str, steps: int, state: RunState) -> float | None:
    """Expected wall-clock seconds for the run to reach `steps` updates from where `state` says it is."""
    rates = _per_update(exp_dir / "data" / arm)
    if not rates:
        per_arm = [statistics.fmean(r) for d in sorted((exp_dir / "data").glob("*/")) if (r := _per_update(d))]
        rates = [statistics.fmean(per_arm)] if per_arm else []
    if not rates:
        return None
    left = steps - (state.checkpoint_update or 0)
    return MARGIN * statistics.fmean(rates) * max(left, 0)


def fits(tag: str, estimate: float | None, until: float | None, now: float | None = None) -> bool:
    """True when the run may start: no deadline, no estimate, or the estimate ends before the deadline. Says why
    not in one line."""
    if until is None or estimate is None:
        return True
    now = time.time() if now is None else now
    if now + estimate <= until:
        return True
    deadline = dt.datetime.fromtimestamp(until, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{tag} not started: it needs ~{estimate / 60:.0f} min (its finished runs, x{MARGIN}), the deadline "
          f"{deadline} is {max(until - now, 0) / 60:.0f} min away; the queue stops here (rerun it to resume)",
          flush=True)
    return False
