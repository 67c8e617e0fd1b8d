"""Crash matrix: the real trainer SIGKILLed at each point of a checkpoint save (through the faults.crash_point hook,
no timing races), then a simulated power loss (every file the save did not fsync is truncated to 0 bytes), then a
resume. Each time the resume loads a good step, sweeps the leftovers, and reproduces the uninterrupted run's
losses within 1e-6. A corrupted newest step is rejected with its reason and the next older one is used."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.faults.faultlib import records, train

pytestmark = pytest.mark.faults

# 4 updates, a checkpoint after each, 2 kept: the save at update 3 writes step_3, moves `latest`, prunes step_1.
RUN = ["trainer.steps=4", "trainer.save_every=1", "trainer.keep_checkpoints=2", "trainer.export_hf=false"]
CRASH_AT = 3
TOL = 1e-6


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> Path:
    """One uninterrupted run shared by the whole matrix."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc = train(*RUN, f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(records(run_dir)) == [1, 2, 3, 4]
    return run_dir


def _power_loss(ckpt_root: Path, fsync_log: Path) -> list[Path]:
    """Truncate every file under the checkpoint root that was never fsynced (what a power cut can lose)."""
    lines = fsync_log.read_text().splitlines() if fsync_log.is_file() else []
    synced = {int(line.split(" ", 1)[0]) for line in lines}  # inodes: they survive the renames after the fsync
    lost = [p for p in ckpt_root.rglob("*") if p.is_file() and p.stat().st_ino not in synced]
    for p in lost:
        p.write_bytes(b"")
    return lost


def _assert_matches_reference(run_dir: Path, reference: Path) -> None:
    ref, got = records(reference), records(run_dir)
    assert sorted(got) == [1, 2, 3, 4], sorted(got)
    for step in (1, 2, 3, 4):
        assert abs(got[step]["loss"] - ref[step]["loss"]) <= TOL, (step, got[step]["loss"], ref[step]["loss"])
        assert got[step]["reward_mean"] == ref[step]["reward_mean"]
    assert len({ref[s]["loss"] for s in ref}) == 4  # the losses do move: the comparison can fail


def _crash_then_resume(point: str, resumed_step: int, reference: Path, tmp_path: Path) -> None:
    run_dir, fsync_log = tmp_path / "run", tmp_path / "fsync.log"
    proc = train(*RUN, f"run.dir={run_dir}", MCORE_RL_CRASH_AT=f"{point}:{CRASH_AT}",
                 MCORE_RL_FSYNC_LOG=str(fsync_log))
    assert proc.returncode == -9, (proc.returncode, proc.stderr[-3000:])  # SIGKILLed at the hook
    ckpt = run_dir / "checkpoints"
    lost = _power_loss(ckpt, fsync_log)
    # only files of an unfinished save (inside its .tmp folder) can be lost; every published file was fsynced
    assert all(".tmp" in p.parent.name for p in lost), lost
    if point == "during_shards":  # killed before any fsync of that save: the power cut takes its shard files
        assert any(p.suffix == ".distcp" for p in lost), lost
    proc = train(*RUN, f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {ckpt / f'step_{resumed_step:06d}'}" in proc.stderr, proc.stderr[-3000:]
    assert not [p for p in ckpt.iterdir() if p.name.endswith((".tmp", ".old"))]  # leftovers swept
    _assert_matches_reference(run_dir, reference)


# (crash point, the step a resume must load). Before `latest` moves the resume takes step_2 (the pointer's target,
# which verifies); after it, step_3.
FAST_CASES = [("after_complete", 2)]
SLOW_CASES = [("during_shards", 2), ("after_rename", 2), ("after_latest", 3), ("during_prune", 3)]


@pytest.mark.parametrize("point,resumed_step", FAST_CASES)
def test_crash_during_save_then_resume(point, resumed_step, reference, tmp_path):
    _crash_then_resume(point, resumed_step, reference, tmp_path)


@pytest.mark.slow  # ~40 s each on a quiet machine
@pytest.mark.parametrize("point,resumed_step", SLOW_CASES)
def test_crash_during_save_then_resume_more_points(point, resumed_step, reference, tmp_path):
    _crash_then_resume(point, resumed_step, reference, tmp_path)


def _truncate_biggest_shard(step: Path) -> str:
    shard = max(step.glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return "bytes, manifest says"


def _flip_byte_in_rank_state(step: Path) -> str:
    f = step / "rank_00000.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    return "fails its CRC32 check"


@pytest.mark.parametrize("corrupt", [_truncate_biggest_shard,
                                     pytest.param(_flip_byte_in_rank_state, marks=pytest.mark.slow)])
def test_corrupt_newest_step_falls_back(corrupt, reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference / "checkpoints", run_dir / "checkpoints")
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step_000004"
    reason = corrupt(ckpt / "step_000004")
    proc = train(*RUN, f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoint step_000004 rejected" in proc.stderr and reason in proc.stderr, proc.stderr[-3000:]
    assert f"resumed from {ckpt / 'step_000003'}" in proc.stderr
    got, ref = records(run_dir), records(reference)
    assert sorted(got) == [4]  # only the redone update was trained
    assert abs(got[4]["loss"] - ref[4]["loss"]) <= TOL, (got[4]["loss"], ref[4]["loss"])
