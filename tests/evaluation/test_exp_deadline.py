"""The queue's deadline (experiments/deadline.py, `--until` / `UNTIL=`): a run expected to end after it is not
started, the queue stops as after `queue.sh --stop`, and the estimate comes from the experiment's finished runs."""

from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path

import pytest

EXP = Path(__file__).resolve().parents[2] / "experiments"
sys.path.insert(0, str(EXP))

from deadline import MARGIN, estimate_s, fits, parse_until  # noqa: E402
from plan import MARKER, RunState  # noqa: E402

NOON = dt.datetime(2026, 11, 27, 12, 0, tzinfo=dt.UTC).timestamp()


def _finished(exp_dir: Path, arm: str, seed: int, walls: list[float], steps: int = 24) -> None:
    d = exp_dir / "data" / arm
    d.mkdir(parents=True, exist_ok=True)
    (d / f"seed{seed}.{MARKER}").write_text(json.dumps({"steps": steps}))
    (d / f"seed{seed}.arm.json").write_text(json.dumps({"segments": [{"wall_s": w} for w in walls]}))


def test_until_is_the_next_such_time_in_utc_or_an_iso_date():
    assert parse_until("12:30", NOON) == NOON + 30 * 60
    assert parse_until("11:30", NOON) == NOON + (24 * 60 - 30) * 60  # passed today: tomorrow's
    assert parse_until("2026-11-28T08:00", NOON) == NOON + 20 * 3600
    with pytest.raises(SystemExit, match=r"--until: expected HH:MM or YYYY-MM-DDTHH:MM \(UTC\), got 'noon'"):
        parse_until("noon", NOON)


def test_estimate_from_the_arms_finished_seeds_else_the_experiments(tmp_path):
    assert estimate_s(tmp_path, "a", 24, RunState()) is None  # nothing finished: no estimate, the run starts
    _finished(tmp_path, "a", 1234, [1000.0, 200.0])  # a resumed seed: both segments count, 50 s per update
    _finished(tmp_path, "a", 1235, [1296.0])  # 54 s per update
    (tmp_path / "data" / "a" / "seed1236.arm.json").write_text('{"segments": [{"wall_s": 9999}]}')  # unfinished
    assert estimate_s(tmp_path, "a", 24, RunState()) == pytest.approx(MARGIN * 52 * 24)
    assert estimate_s(tmp_path, "a", 24, RunState(checkpoint_update=18)) == pytest.approx(MARGIN * 52 * 6)
    _finished(tmp_path, "b", 1234, [480.0], steps=16)  # 30 s per update
    assert estimate_s(tmp_path, "c", 16, RunState()) == pytest.approx(MARGIN * (52 + 30) / 2 * 16)


def test_a_run_that_would_end_past_the_deadline_is_not_started(capsys):
    assert fits("[e/a/seed1]", 600.0, None, NOON) and fits("[e/a/seed1]", None, NOON + 60, NOON)
    assert fits("[e/a/seed1]", 600.0, NOON + 601, NOON)
    assert not fits("[e/a/seed1]", 1500.0, NOON + 600, NOON)
    assert capsys.readouterr().out.strip() == (
        "[e/a/seed1] not started: it needs ~25 min (its finished runs, x1.15), the deadline 2026-11-27 12:10 UTC "
        "is 10 min away; the queue stops here (rerun it to resume)"
    )


def test_the_queue_stops_at_the_first_run_that_does_not_fit(tmp_path, monkeypatch, capsys):
    """arms_main with --until: finished runs are skipped, the first run that would overrun is not started (no
    trainer launched), the report is still written, and the exit is the stop exit queue.sh stops on."""
    import common

    monkeypatch.setattr(common, "EXP_ROOT", tmp_path / "runs")
    monkeypatch.setattr(common, "_STOP", type(common._STOP)())
    arms = [common.Arm("a", "A", [], steps=24), common.Arm("b", "B", [], steps=24)]
    _finished(tmp_path, "a", 1234, [1200.0])  # 50 s per update: a run of b needs ~23 min
    started, reported = [], []
    monkeypatch.setattr(common, "run_arm", lambda *a, **k: started.append(a))
    until = (dt.datetime.now(dt.UTC) + dt.timedelta(minutes=10)).strftime("%Y-%m-%dT%H:%M")
    monkeypatch.setattr(sys, "argv", ["run.py", "--seeds", "1", "--until", until])
    with pytest.raises(SystemExit) as stop:
        common.arms_main("doc", tmp_path, "exp", arms, (), report=reported.append)
    assert stop.value.code == common.STOPPED_EXIT and reported == [tmp_path]
    assert [(arm.name, seed) for _, arm, seed in started] == [("a", 1234)]  # a's skip only: b never launched
    assert "[exp/b/seed1234] not started: it needs ~23 min" in capsys.readouterr().out
