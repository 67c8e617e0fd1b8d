"""Server launcher: health wait, log files, restart after SIGKILL, clean failure, stop on exit."""

from __future__ import annotations

import os
import signal
import time

import pytest

from mcore_rl.rollout.protocol import GenerationRequest, SamplingParams
from mcore_rl.rollout.sglang.launcher import ROUTER_COMMAND, LauncherConfig, ServerLauncher
from mcore_rl.rollout.sglang.remote_engine import SGLangEngine

pytestmark = pytest.mark.rollout


def test_sigkilled_server_is_detected_and_restarted(served):
    victim = served.servers[1]
    old_pid = victim.popen.pid
    assert served.restarts == [0, 0] and served.healthy()
    os.kill(old_pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while not (served.restarts[1] == 1 and served.healthy()):
        assert time.monotonic() < deadline, f"no restart; log:\n{victim.log_path.read_text()[-2000:]}"
        time.sleep(0.2)
    assert victim.popen.pid != old_pid and served.restarts == [0, 1]
    assert victim.log_path.read_text().count("==== ") == 2  # both lives logged to the same file
    with SGLangEngine(served.worker_urls, batch_size=1) as eng:  # both workers serve again
        out = eng.generate([GenerationRequest([3, 4], SamplingParams(max_new_tokens=3)) for _ in range(4)])
    assert [len(s.output_ids) for s in out if s.finish_reason == "length"] and all(s.output_ids for s in out)


def test_failed_start_raises_with_log_tail_and_cleans_up(tmp_path):
    cfg = LauncherConfig(
        model_path="m", num_servers=2, log_dir=str(tmp_path),
        command=["{python}", "-c", "import sys; print('boom: no model at {model_path}'); sys.exit(3)"],
    )  # fmt: skip
    launcher = ServerLauncher(cfg)
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3.*boom: no model at m"):
        launcher.start()
    assert all(p.popen.poll() is not None for p in launcher.servers)
    with pytest.raises(ValueError, match="num_servers"):
        LauncherConfig(model_path="m", num_servers=0)
    with pytest.raises(ValueError, match="gpu_ids"):
        LauncherConfig(model_path="m", num_servers=2, tp_size=2, gpu_ids=[0, 1, 2])


def test_command_templates():
    launcher = ServerLauncher(LauncherConfig(model_path="/m", tp_size=2))
    cmd = launcher._fmt(launcher.cfg.command, model_path="/m", tp_size=2, port=31000, host="0.0.0.0")
    assert cmd[1:] == ["-m", "sglang.launch_server", "--model-path", "/m", "--tp-size", "2", "--port", "31000",
                       "--host", "0.0.0.0"]  # fmt: skip
    urls = ["http://a:1", "http://b:2"]
    router = launcher._fmt(ROUTER_COMMAND, worker_urls=urls, port=30000, host="h", prometheus_port=30001)
    assert router[router.index("--worker-urls") + 1 : router.index("--port")] == urls
