"""`SGLangEngine`: the RolloutEngine protocol over SGLang servers (launched here or already running).

It wraps the asyncio client behind the synchronous protocol with its own event-loop thread, so plain trainer code
can call it and another thread can abort while generate() blocks. When it launched the servers itself, a server
that dies is restarted by the launcher and comes back on the trainer's weights by every transport:
- disk: before it counts as up it replays the newest folder (the last given to update_weights_from_disk,
  tagged with the trainer's version);
- tensor / nccl: the weights live only in the trainer, whose ranks must all take part, so the monitor thread
  only records the restart and keeps the client off that server (`pending_resync`); the next sync point
  (`megatron_sync.resync_restarted`, or the next sync_weights) sends it the weights -- nccl first rebuilds every
  stage group with the new membership.
Samples a stale server produced meanwhile carry an older version and are dropped and generated again by the
client. A server that keeps dying stops the run with one line (EngineFailure).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from mcore_rl.api_key import resolve_api_key
from mcore_rl.rollout.protocol import (
    EngineFailure,
    GenerationRequest,
    PauseMode,
    Sample,
    expand_requests,
    register_engine,
)
from mcore_rl.rollout.sglang import weight_transfer
from mcore_rl.rollout.sglang.client import AsyncSGLangClient, SGLangClientConfig

log = logging.getLogger(__name__)


@dataclass
class RemoteStats:
    regenerated: (
        int  # samples sent again from their prompt after a weight update aborted them (interrupt mode)
    )


@dataclass
class _LoopThread:
    """A private event loop on a daemon thread: sync callers submit coroutines to it."""

    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self.loop.run_forever, name="sglang-client-loop", daemon=True)
        self.thread.start()

    def submit(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro) -> Any:
        return self.submit(coro).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@register_engine("sglang")
class SGLangEngine:
    """RolloutEngine over SGLang servers. Weight sync transports (weight_sync/transports.py) call
    update_weights_from_disk (disk), update_weights (tensor: colocated CUDA IPC) or update_weights_from_distributed
    (nccl)."""

    def __init__(
        self,
        worker_urls: list[str] | None = None,
        router_url: str | None = None,
        *,
        launcher: dict | None = None,
        model_path: str | None = None,
        seed: int | None = None,
        bucket_mb: float = 512.0,
        tp_size: int | None = None,
        nccl: dict | None = None,
        weight_version: int = 0,
        deterministic: bool = True,
        api_key_env: str | None = None,
        api_key_file: str | None = None,
        on_payload: Callable[[str, dict], None] | None = None,
        **client_kwargs: Any,
    ) -> None:
        """`worker_urls` of running servers, or (when empty) `launcher` settings to start them here.

        seed: requests without their own seed get reproducible per-request seeds from it.
        deterministic: seeded sampling (sampling_seed is sent; launched SGLang gets
        --enable-deterministic-inference, without which it ignores seeds).
        nccl: {master_address, master_port, backend} to create the broadcast group on first use.
        """
        api_key = resolve_api_key(file=api_key_file, env=api_key_env, where="rollout.api_key_env")
        self._launcher = None
        self.gpu_ids: list[int] | None = None  # launcher.gpu_ids: server i's TP ranks sit on [i*tp, (i+1)*tp)
        self._restarted: set[str] = set()  # restarted servers still on old weights (tensor / nccl)
        self._regroup: set[str] = set()  # restarted servers that left every broadcast group
        self.sync_mode_seen = "disk"  # the transport of the last update (what a re-sync uses)
        self._replay: tuple[str, int] | None = None  # newest (folder, version) every server loaded
        self._resync_lock = threading.Lock()
        self._lt = _LoopThread()
        if not worker_urls and launcher is not None:
            worker_urls, router_url, tp_size = self._launch(launcher, model_path, deterministic, api_key)
        self.cfg = SGLangClientConfig(worker_urls=list(worker_urls or []), router_url=router_url,
                                      seeded=deterministic, api_key=api_key, **client_kwargs)  # fmt: skip
        self.model_path = model_path
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.nccl = dict(nccl or {})
        self._seeds = random.Random(seed) if seed is not None else None
        tolerate = self._launcher.restarting if self._launcher is not None else None
        self.client = AsyncSGLangClient(
            self.cfg, on_payload=on_payload, version=weight_version, tolerate=tolerate
        )
        # engine TP size: the launched one, else the running servers' own (GET /server_info), read when weight sync
        # first needs it (external servers may still be starting now); a configured value that disagrees is a
        # one-line config error then, before any NCCL rendezvous could hang on it
        self._tp_size: int | None = tp_size
        self._tp_checked = self._launcher is not None
        self.groups: dict[str, Any] = {}  # group_name -> process group (NCCL weight sync, no PP)
        self.stage_groups: set[str] = (
            set()
        )  # per-PP-stage groups the servers joined (weight_sync/pp_broadcast)
        self.restarts_seen = 0

    def _launch(
        self, launcher: dict, model_path: str | None, deterministic: bool, api_key: str | None
    ) -> tuple[list[str], str | None, int]:
        """Start the servers here (rollout.launcher): (worker URLs, router URL or None, TP size per server)."""
        from mcore_rl.rollout.sglang.launcher import LauncherConfig, ServerLauncher

        launch = {**launcher, "model_path": launcher.get("model_path") or model_path}
        launch.setdefault("deterministic", deterministic)
        cfg = LauncherConfig(**launch, api_key=api_key)
        self._launcher = ServerLauncher(cfg, on_restart=self._on_restart).start()
        self.gpu_ids = cfg.gpu_ids
        return self._launcher.worker_urls, self._launcher.router_url, cfg.tp_size

    @property
    def tp_size(self) -> int:
        """Engine TP size per server (payloads per server, broadcast group sizes)."""
        if not self._tp_checked:
            self._tp_size = self._lt.run(self.client.sessions.resolve_tp_size(self._tp_size))
            self._tp_checked = True
        return int(self._tp_size or 1)

    # ------------------------------------------------------------------ restarts
    def _on_restart(self, url: str) -> None:
        """Launcher monitor thread: a restarted server must hold the current weights before it is used."""
        if not hasattr(self, "client"):  # died during start-up: it comes back on the initial weights anyway
            return
        with self._resync_lock:
            self.restarts_seen += 1
            if self.groups or self.stage_groups:
                self._regroup.add(url)
            if self._replay is None:
                if self.weight_version != 0 or self._regroup:
                    log.warning("%s restarted on its initial weights: held out of rotation until the trainer "
                                "re-syncs it (v%d, %s)", url, self.weight_version, self.sync_mode_seen)  # fmt: skip
                    self._restarted.add(url)
                    self.client._down_until[url] = float("inf")  # the client picks it again once re-synced
                return
            path, version = self._replay
            log.warning("%s restarted: replaying weights v%d from %s", url, version, path)
            self._lt.run(self.client.update_weights_from_disk(path, version, urls=[url]))

    def _wait_restarts(self, timeout_s: float = 600.0) -> None:
        """Block until no server is mid-restart (a group or a payload needs every member up)."""
        deadline = time.monotonic() + timeout_s
        while self._launcher is not None and any(self._launcher.restarting(u) for u in self.cfg.worker_urls):
            self._check_alive()
            if time.monotonic() > deadline:
                raise EngineFailure(f"a rollout server did not come back within {timeout_s:.0f}s")
            time.sleep(0.2)

    def pending_resync(self) -> list[str]:
        """Servers that restarted since the weights they hold were sent (after waiting for them to be up)."""
        self._wait_restarts()
        with self._resync_lock:
            return sorted(self._restarted)

    def take_restarted(self) -> list[str]:
        """Servers that left the broadcast groups by restarting since the groups were built; clears the record
        (the caller rebuilds every group)."""
        self._wait_restarts()
        with self._resync_lock:
            out, self._regroup = sorted(self._regroup), set()
            if out:
                self.stage_groups.clear()
            return out

    def mark_resynced(self, urls: Iterable[str]) -> None:
        with self._resync_lock:
            for url in urls:
                self._restarted.discard(url)
                self.client._down_until[url] = 0.0

    def _check_alive(self) -> None:
        msg = self._launcher.failure() if self._launcher is not None else None
        if msg:
            raise EngineFailure(msg)

    @property
    def stats(self) -> RemoteStats:
        """Like LocalEngine.stats, for the counters the old-log-prob sources read."""
        return RemoteStats(regenerated=int(self.client.stats["regenerated"]))

    def set_interrupt_on_update(self, enabled: bool = True) -> None:
        """Interrupt mode (old_logp_source=interrupt|old_logit_model): every weight update is sent with
        abort_all_requests=true and each aborted sample is generated again from its prompt (same sampling_seed)
        under the new weights, so every sample's tokens come from one version (client.py). Checks first that
        every worker answers /abort_request: one line naming the URL otherwise."""
        if enabled:
            from mcore_rl.config.checks import ConfigError

            try:
                self._run(self.client.check_abort())
            except RuntimeError as exc:
                raise ConfigError(str(exc)) from None
        self.client.interrupts.enabled = bool(enabled)

    def fault_metrics(self) -> dict[str, float]:
        """Cumulative counters for the trainer's metrics."""
        return {
            "rollout_http_retries": float(self.client.stats["http_retries"]),
            "rollout_stale_dropped": float(self.client.stats["stale_dropped"]),
            "rollout_server_restarts": float(sum(self._launcher.restarts) if self._launcher else 0),
        }

    def _seeded(self, requests: Sequence[GenerationRequest]) -> list[GenerationRequest]:
        if self._seeds is None:
            return list(requests)
        return [
            r
            if r.sampling.seed is not None
            else replace(r, sampling=replace(r.sampling, seed=self._seeds.getrandbits(62)))
            for r in requests
        ]

    def _run(self, coro) -> Any:
        try:
            return self._lt.run(coro)
        except Exception:
            self._check_alive()  # a dead server explains the failure better than its last HTTP error
            raise

    # ------------------------------------------------------------------ protocol
    @property
    def weight_version(self) -> int:
        return self.client.weight_version

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Sample]:
        self._check_alive()
        return self._run(self.client.generate(self._seeded(requests)))

    def wait(self, futures: Sequence[Future], timeout: float | None = None) -> bool:
        """The servers generate on their own: a plain wait."""
        return not wait(futures, timeout=timeout).not_done

    def submit(self, requests: Sequence[GenerationRequest]) -> list[Future]:
        """Start generating now; one Future[Sample] per sample (request-major), like LocalEngine.submit."""
        self._check_alive()
        requests = self._seeded(requests)
        futures: list[Future] = [Future() for _ in expand_requests(requests)]

        def one(k: int, sample: Sample) -> None:  # as each sample is final (event-loop thread)
            if not futures[k].done():
                futures[k].set_result(sample)

        def fan_out(batch: Future) -> None:
            exc = batch.exception()
            if exc is not None:
                msg = self._launcher.failure() if self._launcher is not None else None
                exc = EngineFailure(msg) if msg else exc
                for f in futures:
                    if not f.done():
                        f.set_exception(exc)
            else:
                for k, sample in enumerate(batch.result()):
                    one(k, sample)

        self._lt.submit(self.client.generate(requests, on_sample=one)).add_done_callback(fan_out)
        return futures

    def abort(self, rid: str | None = None) -> None:
        self._run(self.client.abort(rid))

    def pause(self, mode: PauseMode = "abort") -> None:
        self._run(self.client.pause(mode))

    def resume(self) -> None:
        self._run(self.client.resume())

    def release_memory(self) -> None:
        """SGLang releases memory only from an idle server: pause first (resume_memory continues)."""
        self._run(self.client.pause("abort"))
        self._run(self.client.release_memory())

    def resume_memory(self) -> None:
        self._run(self.client.resume_memory())
        self._run(self.client.resume())

    def health(self) -> bool:
        return self._lt.run(self.client.health())

    def flush_cache(self) -> None:
        self._run(self.client.flush_cache())

    def update_weights_from_disk(self, path: str, version: int) -> None:
        with self._resync_lock:
            self._replay = (str(path), int(version))  # first: a server restarting right now gets this one
            self.sync_mode_seen = "disk"
        self._run(self.client.update_weights_from_disk(path, version))
        self.mark_resynced(self.cfg.worker_urls)

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, urls: list[str] | None = None
    ) -> None:
        """Colocated CUDA IPC (CPU shared memory off GPU): one flat bucket per engine TP rank, each on that
        rank's own device (see weight_transfer). `urls`: only these servers (a re-sync), else all."""
        with self._resync_lock:
            self._replay, self.sync_mode_seen = None, "tensor"
        targets = list(self.cfg.worker_urls if urls is None else urls)
        self._wait_restarts()
        weight_transfer.send_ipc(self, named_tensors, version, targets)
        self.mark_resynced(targets)

    def update_weights_from_distributed(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, group_name: str | None = None
    ) -> None:
        """Announce each bucket over HTTP while broadcasting its tensors from rank 0 of the group (no PP; a
        PP-sharded trainer syncs through megatron_sync, one group per stage)."""
        with self._resync_lock:
            self._replay, self.sync_mode_seen = None, "nccl"
        weight_transfer.broadcast(self, named_tensors, version, group_name)
        self.mark_resynced(self.cfg.worker_urls)

    def init_weights_update_group(
        self, master_address: str, master_port: int, group_name: str = "weight_update_group",
        backend: str = "nccl",
    ):  # fmt: skip
        """Join every server and this process (rank 0) in a side group for broadcasts; returns the group.

        A PP-sharded trainer does not call this: megatron_sync builds one group per stage (pp_broadcast.py).
        """
        return weight_transfer.init_group(self, master_address, master_port, group_name, backend)

    def update_weight_version(self, version: int, abort_all_requests: bool = False) -> None:
        self._run(self.client.update_weight_version(version, abort_all_requests))

    def close(self) -> None:
        try:
            self._lt.run(self.client.close())
        finally:
            self._lt.stop()
            if self._launcher is not None:
                self._launcher.stop()

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
