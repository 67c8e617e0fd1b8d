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
                       "--host", "0.0.0.0", "--mem-fraction-static=0.85"]  # fmt: skip
    urls = ["http://a:1", "http://b:2"]
    router = launcher._fmt(ROUTER_COMMAND, worker_urls=urls, port=30000, host="h", prometheus_port=30001)
    assert router[router.index("--worker-urls") + 1 : router.index("--port")] == urls


# ---- GPU placement (the device query patched: 8 GPUs on a CPU machine) ------------------------------------------
def _plan(monkeypatch, devices: int = 8, visible: str | None = None, local_world: str | None = "2", **kw):
    from mcore_rl.rollout.sglang import placement

    monkeypatch.setattr(placement, "cuda_device_count", lambda: devices)
    for name, value in (("CUDA_VISIBLE_DEVICES", visible), ("LOCAL_WORLD_SIZE", local_world)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    cfg = LauncherConfig(**{"model_path": "/m", "base_port": 31000, "api_key": "k3y", **kw})
    return [(p.env.get("CUDA_VISIBLE_DEVICES"), p.cmd) for p in ServerLauncher(cfg).plan()]


def test_dedicated_servers_take_the_gpus_after_the_trainers(monkeypatch):
    plan = _plan(monkeypatch, num_servers=3, tp_size=2)
    assert [env for env, _ in plan] == ["2,3", "4,5", "6,7"]  # trainer ranks hold 0,1
    for i, (_, cmd) in enumerate(plan):
        assert cmd[cmd.index("--port") + 1] == str(31000 + i) and cmd[cmd.index("--tp-size") + 1] == "2"
        assert "--mem-fraction-static=0.85" in cmd and "--enable-memory-saver" not in cmd
        assert cmd.count("--api-key=k3y") == 1 and "--api-key" not in cmd and "--base-gpu-id" not in cmd


def test_colocated_servers_share_the_trainers_gpus_with_the_memory_saver(monkeypatch):
    plan = _plan(monkeypatch, num_servers=2, tp_size=1, colocate=True)
    assert [env for env, _ in plan] == ["0", "1"]
    assert all("--enable-memory-saver" in cmd and "--mem-fraction-static=0.5" in cmd for _, cmd in plan)
    plan = _plan(monkeypatch, num_servers=1, tp_size=2, colocate=True, mem_fraction_static=0.4)
    assert plan[0][0] == "0,1" and "--mem-fraction-static=0.4" in plan[0][1]


def test_too_few_gpus_is_one_line_naming_the_numbers(monkeypatch):
    from mcore_rl.config import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"^rollout.launcher: 4 servers x tp_size 2 = 8 GPUs \+ 2 trainer GPUs "
        r"\(LOCAL_WORLD_SIZE\) > 8 visible on this node \(0,1,2,3,4,5,6,7\)",
    ):
        _plan(monkeypatch, num_servers=4, tp_size=2)
    with pytest.raises(
        ConfigError, match=r"colocate=true: 3 servers x tp_size 2 = 6 GPUs but this node has 4"
    ):
        _plan(monkeypatch, devices=4, num_servers=3, tp_size=2, colocate=True)


def test_explicit_gpu_ids_win(monkeypatch):
    plan = _plan(monkeypatch, num_servers=2, tp_size=2, gpu_ids=[0, 1, 6, 7])  # even over the trainer's GPUs
    assert [env for env, _ in plan] == ["0,1", "6,7"]


def test_non_contiguous_cuda_visible_devices_are_used_by_their_ids(monkeypatch):
    # a job given GPUs 1,3,4,6,7 (Slurm): torch numbers them 0..4; children need the parent's ids
    plan = _plan(monkeypatch, devices=5, visible="1,3,4,6,7", local_world="1", num_servers=2, tp_size=2)
    assert [env for env, _ in plan] == ["3,4", "6,7"]
    assert [env for env, _ in _plan(monkeypatch, visible="", num_servers=2)] == [
        None,
        None,
    ]  # no GPU: no slice
    single = _plan(
        monkeypatch, devices=2, local_world=None, num_servers=1
    )  # plain `python -m mcore_rl.train`
    assert single[0][0] == "1"


def test_cpu_stand_in_and_custom_commands_get_no_placement(monkeypatch):
    assert [env for env, _ in _plan(monkeypatch, num_servers=8, server="mcore-rl-serve")] == [None] * 8
    assert [env for env, _ in _plan(monkeypatch, num_servers=8, command=["{python}", "-c", "0"])] == [
        None
    ] * 8


def test_mem_fraction_belongs_to_its_key(monkeypatch):
    with pytest.raises(
        ValueError, match="extra_args sets --mem-fraction-static; use rollout.launcher.mem_fraction"
    ):
        LauncherConfig(model_path="/m", extra_args=["--mem-fraction-static", "0.7"])
    with pytest.raises(ValueError, match=r"mem_fraction_static=1.2 must be in \(0, 1\)"):
        LauncherConfig(model_path="/m", mem_fraction_static=1.2)


def test_launcher_keys_through_the_cli_composition(monkeypatch):
    """The trainer's path: rollout.launcher.* overrides -> schema -> LauncherConfig -> command lines."""
    from omegaconf import OmegaConf

    from tests.config.keyscan import compose

    cfg = compose(
        [
            "model=tiny",
            "rollout=sglang",
            "rollout.launcher.num_servers=2",
            "rollout.launcher.tp_size=2",
            "rollout.launcher.colocate=true",
            "rollout.launcher.mem_fraction_static=0.45",
        ]
    )
    launch = OmegaConf.to_container(cfg.rollout.launcher, resolve=False)
    plan = _plan(monkeypatch, local_world="4", **{k: v for k, v in launch.items() if k != "log_dir"})
    assert [env for env, _ in plan] == ["0,1", "2,3"] and "--port" in plan[1][1]
    assert plan[1][1][plan[1][1].index("--port") + 1] == "30001"  # rollout.launcher.base_port=30000 + 1
    assert all("--mem-fraction-static=0.45" in cmd and "--enable-memory-saver" in cmd for _, cmd in plan)
    default = OmegaConf.to_container(
        compose(["model=tiny", "rollout=sglang"]).rollout.launcher, resolve=False
    )
    assert default["colocate"] is False and default["mem_fraction_static"] is None
    plan = _plan(monkeypatch, local_world="4", **{k: v for k, v in default.items() if k != "log_dir"})
    assert plan[0][0] == "4" and "--mem-fraction-static=0.85" in plan[0][1]
