"""A checkpoint save into a tiny full filesystem (a tmpfs the test mounts) fails fast with one clear line on every
rank, the previous checkpoint stays intact and verifiable, and the temp folder is removed."""

from __future__ import annotations

import subprocess
import time

import pytest

from mcore_rl.checkpoint_io import verify_checkpoint
from tests.faults.faultlib import records, train

pytestmark = pytest.mark.faults

# One tiny-model checkpoint (weights + Adam moments) is ~37 MB: 50 MB hold the first save, not the second.
SIZE = "50m"


@pytest.fixture
def tiny_fs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(mnt)],
                              capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a {SIZE} tmpfs here (needs root / CAP_SYS_ADMIN): {proc.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=30)


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=[pytest.mark.multiproc, pytest.mark.slow])])
def test_save_into_full_disk_fails_fast_with_one_line(nproc, tiny_fs):
    run_dir = tiny_fs / "run"
    extra = ["parallel=tp2"] if nproc == 2 else []
    proc = train("trainer.steps=3", "trainer.save_every=1", "trainer.export_hf=false", f"run.dir={run_dir}", *extra,
                 nproc=nproc)
    ended = time.time()
    assert proc.returncode == 1, proc.stderr[-3000:]
    stops = sorted(line for line in proc.stderr.splitlines() if line.startswith("run stopped:"))
    assert len(stops) == nproc, proc.stderr[-3000:]  # one line per rank: every rank learned of it
    ckpt = run_dir / "checkpoints"
    for rank, line in enumerate(stops):
        assert line.startswith(f"run stopped: checkpoint save to {ckpt / 'step_000002'} failed on rank {rank}: "
                               "disk full"), line
        assert "the previous checkpoint is intact and step_000002.tmp was removed" in line
    # no rank printed a traceback (torchrun's launcher prints its own ChildFailedError one for a failed child)
    assert not [line for line in proc.stderr.splitlines() if "Traceback" in line and "[rank" in line]
    assert nproc > 1 or "Traceback" not in proc.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_000001"]  # temp folder gone
    assert verify_checkpoint(ckpt / "step_000001") is None
    assert (ckpt / "latest").read_text().strip() == "step_000001"
    # fast: from update 2's metrics record (just before its save began) to the process exit
    since_save = ended - records(run_dir)[2]["time"]
    assert since_save < 30, f"took {since_save:.1f}s after the save began"
