"""`rollout.*`: one schema per engine (hydra_conf/rollout/<engine>.yaml names its schema in its defaults list).

Every key except the trainer's weight-sync keys (sync_mode, sync_dir, keep_versions: read by trainer/weights.py)
is passed to the engine's constructor (trainer/models.py), so a key here is a constructor argument there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from mcore_rl.config.checks import ConfigError, one_of, positive
from mcore_rl.dtypes import SHORT_OR_LONG


@dataclass
class LocalRolloutConfig:
    """Embedded in-process engine (transformers; rollout/local/engine.py)."""

    engine: str = "local"
    device: str = "auto"            # auto = the trainer's device (cuda:<local rank> when CUDA is up, else cpu)
    dtype: str = "auto"             # auto = the trainer's model.dtype | float32 | bfloat16 | float16
    num_threads: int | None = None  # torch threads for generation (null = leave as is)
    max_batch_size: int = 64        # rows decoded together; more requests queue and join as rows finish
    return_text: bool = True        # decode text (rewards need it)
    weight_layout: str = "auto"     # decode weights [out, in] (out) or [in, out] (in); auto: timed at start (CPU fp32)
    sync_mode: str = "tensor"       # tensor: in-memory copy | disk: safetensors folder + reload
    sync_dir: str | None = None     # disk: where v<N> folders go (null: run.dir/weight_sync)
    keep_versions: int = 2          # disk: v<N> folders kept

    def __post_init__(self) -> None:
        one_of("rollout.engine", self.engine, ("local",))
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"rollout.device={self.device!r}: expected auto, cpu, cuda or cuda:N")
        one_of("rollout.dtype", self.dtype, ("auto", *SHORT_OR_LONG))
        one_of("rollout.sync_mode", self.sync_mode, ("tensor", "disk"))
        one_of("rollout.weight_layout", self.weight_layout, ("auto", "out", "in"))
        positive("rollout.max_batch_size", self.max_batch_size)
        positive("rollout.keep_versions", self.keep_versions)
        if self.num_threads is not None:
            positive("rollout.num_threads", self.num_threads)


@dataclass
class SGLangLauncherSettings:
    """Servers started here when rollout.worker_urls is empty (rollout/sglang/launcher.py LauncherConfig)."""

    server: str = "sglang"          # sglang | mcore-rl-serve (the CPU stand-in used in CI)
    num_servers: int = 1
    tp_size: int = 1                # passed as --tp-size
    host: str = "127.0.0.1"
    base_port: int = 30000          # server i listens on base_port + i (0: free ports)
    gpu_ids: list[int] | None = None  # explicit: server i gets gpu_ids[i*tp:(i+1)*tp] as CUDA_VISIBLE_DEVICES
    colocate: bool = False          # share the trainer's GPUs (memory saver) instead of the next visible ones
    mem_fraction_static: float | None = None  # SGLang's --mem-fraction-static; None: 0.5 colocated, 0.85 dedicated
    extra_args: list[str] = field(default_factory=lambda: ["--weight-version", "0"])
    router: bool = False            # also start sglang-router
    log_dir: str = "rollout_logs"   # one log per server + servers.json
    health_timeout_s: float = 900.0
    max_restarts: int = 3           # per server; then the run stops with one line (exit 3)

    def __post_init__(self) -> None:
        positive("rollout.launcher.num_servers", self.num_servers)
        positive("rollout.launcher.tp_size", self.tp_size)
        positive("rollout.launcher.base_port", self.base_port, allow_zero=True)
        positive("rollout.launcher.max_restarts", self.max_restarts, allow_zero=True)
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ConfigError(f"rollout.launcher.mem_fraction_static={self.mem_fraction_static} must be in (0, 1)")
        if any(str(a).split("=")[0] == "--mem-fraction-static" for a in self.extra_args):
            raise ConfigError("rollout.launcher.extra_args sets --mem-fraction-static; use "
                              "rollout.launcher.mem_fraction_static")


@dataclass
class SGLangRolloutConfig:
    """SGLang servers over HTTP (rollout/sglang/remote_engine.py SGLangEngine)."""

    engine: str = "sglang"
    worker_urls: list[str] = field(default_factory=list)
    router_url: str | None = None   # /generate goes through the router when set
    launcher: SGLangLauncherSettings | None = field(default_factory=SGLangLauncherSettings)
    tp_size: int | None = None      # engine TP per server when not launched here (null: GET /server_info)
    deterministic: bool = False     # seeded sampling (launched servers get --enable-deterministic-inference);
    #                                 on in runs with trainer.deterministic=true (engine_determinism below)
    api_key_env: str | None = None  # env var holding the servers' API key; never put the key itself here
    api_key_file: str | None = None  # or a file holding it (mode 600)
    sync_mode: str = "disk"         # disk | tensor (colocated CUDA IPC) | nccl
    sync_dir: str | None = "${run.dir}/weight_sync"
    keep_versions: int = 2
    bucket_mb: float = 512.0        # tensor/nccl: payload bucket size
    nccl: dict[str, Any] | None = None  # {master_address, master_port, backend} for sync_mode=nccl
    max_concurrency: int = 64       # HTTP client
    batch_size: int = 32            # samples per /generate call to a worker
    timeout_s: float = 3600.0
    control_timeout_s: float = 600.0
    retries: int = 3
    backoff_s: float = 0.5
    stale_retries: int = 8          # a sample generated on stale weights (restarted server) is generated again

    def __post_init__(self) -> None:
        one_of("rollout.engine", self.engine, ("sglang",))
        one_of("rollout.sync_mode", self.sync_mode, ("disk", "tensor", "nccl"))
        if not self.worker_urls and self.launcher is None:
            raise ConfigError("rollout: give rollout.worker_urls or rollout.launcher settings")
        if self.sync_mode == "nccl" and not self.nccl:
            raise ConfigError("rollout.sync_mode=nccl needs rollout.nccl={master_address: ..., master_port: ...}")
        for key in ("keep_versions", "max_concurrency", "batch_size"):
            positive(f"rollout.{key}", getattr(self, key))
        if self.tp_size is not None:
            positive("rollout.tp_size", self.tp_size)
        for key in ("retries", "stale_retries"):
            positive(f"rollout.{key}", getattr(self, key), allow_zero=True)
