"""A stop signal (Slurm preemption, USR1) that lands inside a long generation round is honoured at once:
the in-flight requests are aborted, the partial round is dropped, the run checkpoints and exits 0 with
run.dir/PREEMPTED -- instead of finishing a round that may outlast the job's remaining time."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e

LONG_ROUND = ["model=tiny", "trainer.steps=3", "trainer.prompts_per_update=2", "trainer.samples_per_prompt=2",
              "trainer.max_new_tokens=1500", "eval.num_prompts=0", "trainer.save_every=0",
              "trainer.export_hf=false", "logging.progress=false", "logging.plot=false"]


def test_stop_inside_generation_round_drops_it_and_checkpoints(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, "-m", "mcore_rl.train", *LONG_ROUND, f"run.dir={tmp_path}"], env=env,
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 400
    while not (metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no first update"
        time.sleep(0.2)
    first = json.loads(metrics.read_text().splitlines()[0])
    time.sleep(1.0)  # round 2 is generating now (a round takes first["time_generate"] seconds)
    t_signal = time.time()
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    stamp = re.search(r"\[(\S+ \S+) mcore_rl\] stop requested during generation: aborted round 1", err)
    assert stamp, err[-3000:]
    aborted_after = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - t_signal
    print(f"a round of generation takes {first['time_generate']:.1f}s; aborted {aborted_after:.2f}s after the signal")
    assert first["time_generate"] > 3.0  # the round really is long ...
    assert aborted_after < 0.3 * first["time_generate"]  # ... and the stop did not wait for it to finish
    assert "stop requested during generation: aborted round 1" in err
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1]  # partial round dropped
    assert json.loads((tmp_path / "PREEMPTED").read_text())["update"] == 1
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000001"
    meta = json.loads((tmp_path / "checkpoints" / "step_000001" / "complete.json").read_text())
    assert meta["trainer"]["round"] == 1  # the dropped round is generated again after a resume
