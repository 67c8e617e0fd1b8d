"""Start, watch and stop N rollout servers (SGLang by default) and an optional sglang-router in front.

Each server runs in its own session (so stop() takes its child processes too), logs to its own file, and must
answer /health before start() returns. A monitor thread restarts a server whose process died (up to
`max_restarts` times each). Everything is stopped on exit: context manager + atexit.
The command is a template so tests (and CPU machines) can launch `mcore-rl-serve` instead of SGLang.
After a restart, `on_restart(url)` runs (the engine replays the current weights there) before the server
counts as up again. The API key reaches children as $MCORE_RL_API_KEY; only commands that cannot read it
from there (SGLang, the router) get `--api-key` through the `{api_key_args}` placeholder, and logged command
lines show it as ***. `log_dir/servers.json` lists pid, url and restarts of every process (for operators).
The key always travels as `--api-key=<key>`: one token, so a key is never read as an option of its own.
GPU placement (placement.py): each server gets its own CUDA_VISIBLE_DEVICES slice of the node's visible devices,
after the trainer's (disaggregated) or on them (`colocate`, with SGLang's memory saver); never all on GPU 0.
`mem_fraction_static` (SGLang's --mem-fraction-static) defaults to 0.5 colocated, 0.85 on dedicated GPUs.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from mcore_rl.api_key import API_KEY_ENV
from mcore_rl.config.rollout import SGLangLauncherSettings
from mcore_rl.rollout.sglang.placement import Placement, place_servers

log = logging.getLogger(__name__)

SGLANG_COMMAND = [
    "{python}", "-m", "sglang.launch_server", "--model-path", "{model_path}", "--tp-size", "{tp_size}",
    "--port", "{port}", "--host", "{host}", "--mem-fraction-static={mem_fraction_static}", "{api_key_args}",
]  # fmt: skip
MCORE_RL_SERVE_COMMAND = [
    "{python}", "-m", "mcore_rl.rollout.server", "--model-path", "{model_path}", "--port", "{port}",
    "--host", "{host}",
]  # fmt: skip
ROUTER_COMMAND = [
    "{python}", "-m", "sglang_router.launch_router", "--worker-urls", "{worker_urls}", "--port", "{port}",
    "--host", "{host}", "--prometheus-port", "{prometheus_port}", "--health-check-interval-secs", "2",
    "--log-level", "warn", "{api_key_args}",
]  # fmt: skip
COMMANDS: dict[str, list[str]] = {"sglang": SGLANG_COMMAND, "mcore-rl-serve": MCORE_RL_SERVE_COMMAND}
GPU_SERVERS = frozenset({"sglang"})  # servers that run on GPUs and get a placement (mcore-rl-serve: CPU, CI)
# Server flags switched on by LauncherConfig booleans (SGLang's names; mcore-rl-serve accepts them too).
# memory_saver: release/resume_memory_occupation are silent no-ops in SGLang without it.
# deterministic: SGLang ignores sampling_seed without it.
FLAGS: dict[str, list[str]] = {
    "memory_saver": ["--enable-memory-saver"],
    "deterministic": ["--enable-deterministic-inference"],
}


# SGLang's --mem-fraction-static (weights + KV cache share of GPU memory): colocated servers leave room for the
# trainer's activations when they resume; a dedicated GPU gives SGLang nearly all of it.
MEM_FRACTION = {"colocated": 0.5, "dedicated": 0.85}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def http_ok(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass(kw_only=True)
class LauncherConfig(SGLangLauncherSettings):
    """Everything the launcher needs: the user's `rollout.launcher.*` settings (SGLangLauncherSettings: their one
    definition, defaults and checks) plus what the engine and trainer fill in. Two defaults differ for
    programmatic use (tools, tests): free ports and no extra server flags."""

    model_path: str
    base_port: int = 0  # 0: pick free ports
    extra_args: list[str] = field(default_factory=list)
    command: list[str] | None = None  # a template of its own instead of COMMANDS[server]
    router_port: int = 0
    router_command: list[str] = field(default_factory=lambda: list(ROUTER_COMMAND))
    monitor: bool = True
    monitor_interval_s: float = 2.0
    env: dict[str, str] = field(default_factory=dict)
    memory_saver: bool = False  # the schedule releases engine memory between rounds
    deterministic: bool = False  # seeded sampling requested
    api_key: str | None = field(default=None, repr=False)
    trainer_gpus: int | None = None  # trainer processes on this node (None: $LOCAL_WORLD_SIZE, else 1)
    # give each server its own GPUs (placement.py); None: yes for SGLang's own command, no for the CPU stand-in
    # and for a custom `command` (those follow explicit gpu_ids only)
    place_gpus: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.place_gpus is None:
            self.place_gpus = self.command is None and self.server in GPU_SERVERS
        if self.command is None:
            if self.server not in COMMANDS:
                raise ValueError(f"rollout.launcher.server={self.server!r}: expected one of {sorted(COMMANDS)}")
            self.command = list(COMMANDS[self.server])
        if self.gpu_ids is not None and len(self.gpu_ids) < self.num_servers * self.tp_size:
            raise ValueError(
                f"LauncherConfig.gpu_ids has {len(self.gpu_ids)} GPUs for {self.num_servers} x tp {self.tp_size}"
            )
        if self.mem_fraction_static is None:
            self.mem_fraction_static = MEM_FRACTION["colocated" if self.colocate else "dedicated"]
        if self.colocate:
            self.memory_saver = True  # the trainer needs the memory back between rounds


@dataclass
class _Proc:
    name: str
    cmd: list[str]
    url: str
    env: dict[str, str]
    log_path: Path
    popen: subprocess.Popen | None = None
    log_file: IO | None = None
    restarts: int = 0
    failed: bool = False
    restarting: bool = False


class ServerLauncher:
    def __init__(self, cfg: LauncherConfig, on_restart: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.on_restart = on_restart
        self.servers: list[_Proc] = []
        self.router: _Proc | None = None
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def worker_urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def router_url(self) -> str | None:
        return self.router.url if self.router else None

    @property
    def restarts(self) -> list[int]:
        return [s.restarts for s in self.servers]

    def failure(self) -> str | None:
        """One line naming a server whose restart budget is spent, or None."""
        for p in self.servers + ([self.router] if self.router else []):
            if p.failed:
                return (f"rollout {p.name} at {p.url} kept dying: restarted {p.restarts} times "
                        f"(max_restarts={self.cfg.max_restarts}); see {p.log_path}")  # fmt: skip
        return None

    def restarting(self, url: str) -> bool:
        """True while the server at `url` is dead or coming back (control calls to it may be skipped)."""
        for p in self.servers:
            if p.url == url:
                return p.restarting or p.popen is None or p.popen.poll() is not None
        return False

    def _write_state(self) -> None:
        state = [{"name": p.name, "url": p.url, "pid": p.popen.pid if p.popen else None, "restarts": p.restarts,
                  "failed": p.failed} for p in self.servers + ([self.router] if self.router else [])]  # fmt: skip
        tmp = Path(self.cfg.log_dir) / ".servers.json.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, Path(self.cfg.log_dir) / "servers.json")

    def _fmt(self, template: list[str], **values) -> list[str]:
        values = {"mem_fraction_static": self.cfg.mem_fraction_static, **values}
        out: list[str] = []
        for tok in template:
            if tok == "{worker_urls}":
                out.extend(values["worker_urls"])
            elif tok == "{api_key_args}":
                out.extend([f"--api-key={self.cfg.api_key}"] if self.cfg.api_key else [])
            else:
                out.append(
                    tok.format(
                        python=sys.executable, **{k: v for k, v in values.items() if k != "worker_urls"}
                    )
                )
        return out

    def placement(self) -> Placement:
        cfg = self.cfg
        if not cfg.place_gpus and cfg.gpu_ids is None:
            return Placement([[] for _ in range(cfg.num_servers)], [], 0, cfg.colocate)
        return place_servers(cfg.num_servers, cfg.tp_size, colocate=cfg.colocate, gpu_ids=cfg.gpu_ids,
                             trainer_gpus=cfg.trainer_gpus)  # fmt: skip

    def plan(self) -> list[_Proc]:
        """The servers to start: command line, URL and environment (CUDA_VISIBLE_DEVICES) each; nothing runs."""
        cfg = self.cfg
        placement = self.placement()
        procs = []
        for i, gpus in enumerate(placement.per_server):
            port = cfg.base_port + i if cfg.base_port else free_port(cfg.host)
            values = dict(model_path=cfg.model_path, tp_size=cfg.tp_size, port=port, host=cfg.host,
                          mem_fraction_static=cfg.mem_fraction_static)  # fmt: skip
            env = dict(cfg.env)
            if cfg.api_key:
                env[API_KEY_ENV] = cfg.api_key
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
            procs.append(_Proc(
                f"server{i}",
                self._fmt(cfg.command, **values)
                + [flag for key, flags in FLAGS.items() if getattr(cfg, key) for flag in flags]
                + [str(a) for a in cfg.extra_args],
                f"http://{cfg.host}:{port}", env, Path(cfg.log_dir) / f"server{i}.log",
            ))  # fmt: skip
        if any(placement.per_server):
            log.warning("rollout servers on GPUs %s (%s; visible %s, trainer %d)",
                        [p.env["CUDA_VISIBLE_DEVICES"] for p in procs],
                        "colocated" if cfg.colocate else "dedicated", ",".join(placement.visible),
                        placement.trainer_gpus)  # fmt: skip
        return procs

    def start(self) -> ServerLauncher:
        cfg = self.cfg
        procs = self.plan()  # a placement error surfaces before anything is started
        Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop)
        for proc in procs:
            self.servers.append(proc)
            self._spawn(proc)
        try:
            for i in range(len(self.servers)):
                self._wait_healthy_rebinding(i)
            if cfg.router:
                port = cfg.router_port or free_port(cfg.host)
                cmd = self._fmt(cfg.router_command, worker_urls=self.worker_urls, port=port, host=cfg.host,
                                prometheus_port=free_port(cfg.host))  # fmt: skip
                self.router = _Proc(
                    "router",
                    cmd,
                    f"http://{cfg.host}:{port}",
                    dict(cfg.env),
                    Path(cfg.log_dir) / "router.log",
                )
                self._spawn(self.router)
                self._wait_healthy(self.router)
        except BaseException:
            self.stop()
            raise
        self._write_state()
        if cfg.monitor:
            self._monitor = threading.Thread(target=self._watch, name="rollout-launcher-monitor", daemon=True)
            self._monitor.start()
        return self

    def _wait_healthy_rebinding(self, i: int, attempts: int = 3) -> None:
        """Wait for server i; if another process took its free port before it bound it, start it on a new one."""
        for attempt in range(attempts):
            try:
                return self._wait_healthy(self.servers[i])
            except RuntimeError as exc:
                lost = "address already in use" in str(exc).lower() and not self.cfg.base_port
                if not lost or attempt == attempts - 1:
                    raise
                proc = self.plan()[i]  # the same server with another free port
                log.warning("%s: port taken before it bound; starting it again at %s", proc.name, proc.url)
                self.servers[i] = proc
                self._spawn(proc)

    def _spawn(self, proc: _Proc) -> None:
        proc.log_file = open(proc.log_path, "ab")  # noqa: SIM115 -- lives as long as the process
        key = self.cfg.api_key
        shown = " ".join(tok.replace(key, "***") if key else tok for tok in proc.cmd)
        proc.log_file.write(f"\n==== {time.strftime('%F %T')} start: {shown}\n".encode())
        proc.log_file.flush()
        proc.popen = subprocess.Popen(
            proc.cmd, stdout=proc.log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **proc.env}, start_new_session=True,
        )  # fmt: skip
        log.info("launched %s pid=%d at %s (log %s)", proc.name, proc.popen.pid, proc.url, proc.log_path)

    def _log_tail(self, proc: _Proc, n: int = 3000) -> str:
        try:
            return proc.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def _wait_healthy(self, proc: _Proc) -> None:
        deadline = time.monotonic() + self.cfg.health_timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            if proc.popen.poll() is not None:
                raise RuntimeError(
                    f"{proc.name} exited with code {proc.popen.returncode} before /health; log {proc.log_path}:\n"
                    f"{self._log_tail(proc)}"
                )
            if http_ok(proc.url + "/health"):
                return
            time.sleep(0.25)
        raise TimeoutError(
            f"{proc.name} at {proc.url} not healthy after {self.cfg.health_timeout_s}s; log {proc.log_path}"
        )

    def _watch(self) -> None:
        while not self._stop.wait(self.cfg.monitor_interval_s):
            for proc in self.servers + ([self.router] if self.router else []):
                with self._lock:
                    if self._stop.is_set() or proc.failed or proc.popen.poll() is None:
                        continue
                    code = proc.popen.returncode
                    if proc.restarts >= self.cfg.max_restarts:
                        proc.failed = True
                        log.error("%s died (code %s); restart budget %d spent", proc.name, code,
                                  self.cfg.max_restarts)  # fmt: skip
                        self._write_state()
                        continue
                    proc.restarts += 1
                    proc.restarting = True
                    log.warning("%s died (code %s); restart %d/%d", proc.name, code, proc.restarts,
                                self.cfg.max_restarts)  # fmt: skip
                    _killpg(proc.popen.pid, signal.SIGKILL)  # orphaned children of the dead server
                    self._close_log(proc)
                    self._spawn(proc)
                    self._write_state()
                try:
                    self._wait_healthy(proc)
                    if self.on_restart is not None and proc is not self.router:
                        self.on_restart(proc.url)  # e.g. replay the current weights before it counts as up
                except Exception as exc:  # noqa: BLE001 -- the monitor must survive; the next pass retries
                    log.error("%s restart failed: %s", proc.name, exc)
                finally:
                    proc.restarting = False

    def healthy(self) -> bool:
        procs = self.servers + ([self.router] if self.router else [])
        return all(p.popen.poll() is None and http_ok(p.url + "/health") for p in procs)

    @staticmethod
    def _close_log(proc: _Proc) -> None:
        if proc.log_file is not None:
            proc.log_file.close()
            proc.log_file = None

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM every process group we started, SIGKILL what is left after `timeout`."""
        self._stop.set()
        with self._lock:
            procs = ([self.router] if self.router else []) + self.servers
            for proc in procs:
                if proc.popen is not None:
                    _killpg(proc.popen.pid, signal.SIGTERM)  # also children of a server that already died
            deadline = time.monotonic() + timeout
            for proc in procs:
                if proc.popen is None:
                    continue
                try:
                    proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _killpg(proc.popen.pid, signal.SIGKILL)
                    proc.popen.wait(timeout=10)
                self._close_log(proc)
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=5)
        atexit.unregister(self.stop)

    def __enter__(self) -> ServerLauncher:
        return self.start() if not self.servers else self

    def __exit__(self, *exc) -> None:
        self.stop()
