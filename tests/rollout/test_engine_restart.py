"""Engine crash handling, end to end: the trainer launches two mcore-rl-serve workers behind the real
sglang-router (with an API key from an env var); one worker is SIGKILLed mid-round; the launcher restarts it,
the engine replays the current weights there (its weight_version comes back equal to the trainer's), failed
requests are retried, stale samples dropped, and the run finishes with the counts in its metrics.
A server that keeps dying stops the engine with one clear line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from mcore_rl.rollout.protocol import EngineFailure, GenerationRequest, SamplingParams
from mcore_rl.rollout.sglang.remote_engine import SGLangEngine
from tests.conftest import REPO
from tests.e2e.test_train_tiny import _env, records, train_cmd

pytestmark = pytest.mark.rollout
KEY_ENV = "MCORE_RL_TEST_API_KEY"


def model_version(url: str, key: str) -> str | None:
    req = urllib.request.Request(url + "/model_info", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())["weight_version"]
    except OSError:
        return None


def wait_for(cond, timeout: float, what: str, proc: subprocess.Popen | None = None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"training exited ({proc.returncode}) while waiting for {what}:\n{proc.stderr.read()[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


@pytest.mark.slow
def test_sigkill_worker_mid_round_restart_resync_and_finish(tmp_path):
    key = "restart-test-key-0123"
    cmd = train_cmd(
        "rollout=sglang", "rollout.launcher.server=mcore-rl-serve", "rollout.launcher.num_servers=2",
        "rollout.launcher.router=true", "rollout.launcher.base_port=0", "rollout.launcher.extra_args=[--num-threads,1]",
        "rollout.launcher.health_timeout_s=180", f"rollout.api_key_env={KEY_ENV}", "trainer.steps=30",
        "trainer.deterministic=true",  # off by default with SGLang; on, it must reach the servers' flag
        "trainer.max_new_tokens=24", "trainer.prompts_per_update=4", f"run.dir={tmp_path}", "trainer.export_hf=false",
        "logging.plot=false", "rollout.backoff_s=0.5",
    )  # fmt: skip
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env={**_env(), KEY_ENV: key}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        state_file = tmp_path / "rollout_logs" / "servers.json"
        wait_for(state_file.is_file, 240, "servers.json", proc)
        wait_for(lambda: len(records(tmp_path)) >= 1, 300, "the first update", proc)
        servers = json.loads(state_file.read_text())
        victim = next(s for s in servers if s["name"] == "server1")
        other = next(s for s in servers if s["name"] == "server0")
        os.kill(victim["pid"], signal.SIGKILL)  # round 2 is generating now
        killed_at = len(records(tmp_path))

        def restarted():
            now = {s["name"]: s for s in json.loads(state_file.read_text())}
            return now["server1"]["restarts"] == 1 and now["server1"]["pid"] != victim["pid"]

        wait_for(restarted, 120, "the restart", proc)

        def resynced():  # the restarted worker came up on v0; it must reach the trainer's version
            v_new, v_old = model_version(victim["url"], key), model_version(other["url"], key)
            return v_new is not None and v_new == v_old and int(v_new) >= killed_at and (v_new, v_old)

        versions = wait_for(resynced, 120, "the restarted worker's weights", proc)
        assert model_version(victim["url"], "wrong-key") is None  # 401 without the right key
        req = urllib.request.Request(victim["url"] + "/server_info", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            info = json.loads(resp.read())
        assert info["enable_deterministic_inference"] is True  # trainer.deterministic -> the launcher's flag
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-4000:]
    assert key not in err and key not in (tmp_path / "rollout_logs" / "server1.log").read_text()
    assert "restarted: replaying weights" in err
    recs = records(tmp_path)
    assert [r["step"] for r in recs] == list(range(1, 31))
    last = recs[-1]
    assert last["rollout_server_restarts"] == 1
    for k in ("rollout_stale_dropped", "rollout_http_retries"):
        assert k in last
    print(f"restart run: {time.time() - t0:.0f}s, resynced at v{versions[0]}, stale dropped "
          f"{last['rollout_stale_dropped']:.0f}, http retries {last['rollout_http_retries']:.0f}", file=sys.stderr)


def test_server_that_keeps_dying_stops_the_engine_with_one_line(tiny_dir, tmp_path):
    launcher = {"server": "mcore-rl-serve", "base_port": 0, "extra_args": ["--num-threads", "1"],
                "log_dir": str(tmp_path), "max_restarts": 0, "monitor_interval_s": 0.2, "health_timeout_s": 120}
    with SGLangEngine(launcher=launcher, model_path=str(tiny_dir), retries=0) as eng:
        pid = eng._launcher.servers[0].popen.pid
        os.kill(pid, signal.SIGKILL)
        wait_for(eng._launcher.failure, 30, "the launcher to give up")
        with pytest.raises(EngineFailure) as info:
            eng.generate([GenerationRequest([1, 2], SamplingParams(max_new_tokens=2))])
    msg = str(info.value)
    assert "\n" not in msg and "server0" in msg and "max_restarts=0" in msg and str(tmp_path) in msg
    assert json.loads((Path(tmp_path) / "servers.json").read_text())[0]["failed"] is True


def test_direct_workers_retry_elsewhere_and_drop_stale_samples(tiny_dir, tiny_alt_dir, tmp_path):
    """Without a router the client does it: a dead worker's requests go to another worker (http_retries), and
    samples from a worker whose weights are older than the call's version are dropped and made again."""
    launcher = {"server": "mcore-rl-serve", "num_servers": 2, "base_port": 0, "extra_args": ["--num-threads", "1"],
                "log_dir": str(tmp_path), "monitor": False, "health_timeout_s": 120}  # fmt: skip
    with SGLangEngine(launcher=launcher, model_path=str(tiny_dir), batch_size=1, backoff_s=0.05) as eng:
        eng.update_weights_from_disk(str(tiny_alt_dir), 3)
        stale_url = eng.cfg.worker_urls[1]
        req = urllib.request.Request(stale_url + "/update_weight_version", b'{"new_version": "1"}',
                                     {"Content-Type": "application/json"})  # fmt: skip
        urllib.request.urlopen(req, timeout=30).read()  # worker 1 now claims older weights (as after a restart)
        reqs = [GenerationRequest([3, 4, i], SamplingParams(max_new_tokens=3, ignore_eos=True)) for i in range(6)]
        out = eng.generate(reqs)
        assert all(s.weight_versions == [3] * 3 for s in out)
        dropped = eng.fault_metrics()["rollout_stale_dropped"]
        assert dropped >= 1  # least-loaded dispatch sent some to worker 1; they came back v1 and were redone
        eng.client._down_until = dict.fromkeys(eng.cfg.worker_urls, 0.0)  # forget worker 1's stale episode
        os.kill(eng._launcher.servers[1].popen.pid, signal.SIGKILL)
        eng._launcher.servers[1].popen.wait()
        out = eng.generate(reqs)
        assert len(out) == 6 and all(s.weight_versions == [3] * 3 for s in out)
        assert eng.fault_metrics()["rollout_http_retries"] >= 1  # the dead worker's share went to worker 0
    print(f"direct workers: {dropped:.0f} stale samples dropped and redone", file=sys.stderr)
