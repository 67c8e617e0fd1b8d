"""fsio: the one module that writes folders atomically and durably (checkpoints, conversion, model materialiser)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mcore_rl import faults, fsio

pytestmark = pytest.mark.faults


def test_atomic_dir_publishes_durably_and_logs_every_fsync(tmp_path, monkeypatch):
    log = tmp_path / "fsync.log"
    monkeypatch.setenv(faults.FSYNC_LOG_ENV, str(log))
    out = tmp_path / "out"
    with fsio.atomic_dir(out) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "a.bin").write_bytes(b"x" * 10)
        (tmp / "sub" / "b.txt").write_text("hi")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fsync.log", "out"]
    synced = {int(line.split()[0]) for line in log.read_text().splitlines()}
    for p in (out, out / "sub", out / "a.bin", out / "sub" / "b.txt", tmp_path):  # files, dirs and the parent
        assert os.stat(p).st_ino in synced, p


def test_atomic_dir_error_keeps_old_and_removes_tmp(tmp_path):
    out = tmp_path / "out"
    with fsio.atomic_dir(out) as tmp:
        (tmp / "v").write_text("1")
    with pytest.raises(RuntimeError, match="boom"), fsio.atomic_dir(out, overwrite=True) as tmp:
        (tmp / "v").write_text("2")
        raise RuntimeError("boom")
    assert (out / "v").read_text() == "1" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with pytest.raises(FileExistsError, match="exists; pass overwrite"), fsio.atomic_dir(out):
        pass
    with fsio.atomic_dir(out, overwrite=True) as tmp:
        (tmp / "v").write_text("3")
    assert (out / "v").read_text() == "3" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_crash_between_swap_renames_leaves_a_recoverable_old(tmp_path):
    """SIGKILL between final->final.old and tmp->final: `final` is gone for an instant, but both versions are
    on disk under names the sweep (and a resume's fallback) understand."""
    out = tmp_path / "out"
    code = f"""
from pathlib import Path
from mcore_rl import faults, fsio
out = Path({str(out)!r})
with fsio.atomic_dir(out) as t:
    (t / "v").write_text("old")
tmp = fsio.prepare_staging(out, overwrite=True)
(tmp / "v").write_text("new")
fsio.commit_staging(tmp, out, on_swap=lambda: faults.crash_point("between_swap"))
"""
    env = {**os.environ, faults.CRASH_ENV: "between_swap"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, timeout=60)
    assert proc.returncode == -9
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.old", "out.tmp"]
    assert (tmp_path / "out.old" / "v").read_text() == "old"
    assert [p.name for p in fsio.sweep_stale(tmp_path)] == ["out.old", "out.tmp"]
    assert list(tmp_path.iterdir()) == []


def test_remove_tree_renames_out_of_the_namespace_first(tmp_path):
    victim = tmp_path / "step_000001"
    victim.mkdir()
    (victim / "complete.json").write_text("{}")
    seen = []
    fsio.remove_tree(victim, on_renamed=lambda: seen.append(sorted(p.name for p in tmp_path.iterdir())))
    assert seen == [["step_000001.old"]] and list(tmp_path.iterdir()) == []


def test_publish_new_loses_a_race_gracefully(tmp_path):
    final = tmp_path / "cache"
    for v in ("first", "second"):
        t = tmp_path / f".t-{v}"
        t.mkdir()
        (t / "v").write_text(v)
        fsio.publish_new(t, final)
    assert (final / "v").read_text() == "first" and sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
