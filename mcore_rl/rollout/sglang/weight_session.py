"""SGLang's weight-update protocol around in-memory updates, per worker: sessions, group re-joins, engine TP size.

Why: SGLang 0.5.23 refuses `/update_weights_from_tensor` and `/update_weights_from_distributed` (HTTP 400) unless
`POST /begin_weight_update {selector}` opened a session, closed by `POST /end_weight_update {}` (read in its
`scheduler_components/weight_updater.py`). A refused distributed update leaves the trainer blocked in its
broadcast, so every bucketed update opens a session on every worker first and closes it even when the update
fails. Older servers have no such routes (404): they get the sequence without a session (remembered per worker).
A weight-update group name stays taken on a long-lived server until `/destroy_weights_update_group`, so a
restarted trainer destroys it before joining again. The engine TP size decides the group's world size and the
tensor payload count; a wrong one hangs the rendezvous, so it is read from each server's `GET /server_info`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import TYPE_CHECKING, Any

from mcore_rl.config.checks import ConfigError
from mcore_rl.rollout.sglang.api import init_group_payload

if TYPE_CHECKING:
    from mcore_rl.rollout.sglang.client import AsyncSGLangClient

log = logging.getLogger(__name__)
SELECTOR = "all"  # target and (when the server has one) draft model


class WeightSessions:
    """Session state of one client: which workers have a session open, which have no session routes."""

    def __init__(self, client: AsyncSGLangClient) -> None:
        self.client = client
        self.legacy: set[str] = set()  # workers that answered 404 to /begin_weight_update
        self.open: list[str] = []  # workers with a session this client opened
        self.error: BaseException | None = None  # first failed update inside the current session
        self.tp_sizes: dict[str, int | None] = {}  # worker -> its engine TP size (None: not reported)

    # ------------------------------------------------------------------ sessions
    async def begin(self) -> None:
        """Open a session on every live worker; on any failure close those opened and raise the first error."""
        from mcore_rl.rollout.sglang.transport import SGLangHTTPError

        self.error = None
        urls = self.client.live_workers()
        results = await asyncio.gather(
            *(self._begin_one(u, SGLangHTTPError) for u in urls), return_exceptions=True
        )
        self.open = [u for u, r in zip(urls, results) if r is True]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.error = errors[0]
            await self.end()
            raise errors[0]

    async def _begin_one(self, url: str, http_error: type) -> bool:
        if url in self.legacy:
            return False
        body = {"selector": SELECTOR}
        try:
            await self.client.request("POST", url, "/begin_weight_update", body)
        except http_error as exc:
            if exc.status == 404:
                self.legacy.add(url)
                log.warning("%s has no /begin_weight_update (SGLang before 0.5.23): weight updates without a "
                            "session there", url)  # fmt: skip
                return False
            if exc.status != 400 or "already open" not in exc.body:
                raise
            log.warning("%s: a weight-update session was left open (a trainer stopped mid-update?); closing it and "
                        "opening a new one", url)  # fmt: skip
            await self.client.request("POST", url, "/end_weight_update", {}, retries=0)
            await self.client.request("POST", url, "/begin_weight_update", body, retries=0)
        return True

    def failed(self, exc: BaseException) -> None:
        """An update inside the session failed: that error is the one the caller sees."""
        if self.error is None:
            self.error = exc

    async def end(self) -> None:
        """Close every session opened. A closing failure is raised only when the update itself went through."""
        urls, self.open = self.open, []
        results = await asyncio.gather(
            *(self.client.request("POST", u, "/end_weight_update", {}) for u in urls), return_exceptions=True
        )
        tolerate = self.client.tolerate or (lambda url: False)  # a worker restarting has no session anyway
        errors = [(u, r) for u, r in zip(urls, results) if isinstance(r, BaseException) and not tolerate(u)]
        if not errors:
            return
        if self.error is not None:  # the update's own error propagates; this one is only logged
            for url, exc in errors:
                log.error("%s/end_weight_update after a failed update: %s", url, exc)
            return
        raise errors[0][1]

    # ------------------------------------------------------------------ groups
    async def destroy_group(self, group_name: str) -> None:
        """Leave `group_name` on every worker (a previous trainer's group); 'does not exist' is fine."""
        from mcore_rl.rollout.sglang.transport import SGLangHTTPError

        async def one(url: str) -> None:
            try:
                await self.client.request("POST", url, "/destroy_weights_update_group", {"group_name": group_name},
                                          retries=0)  # fmt: skip
                log.info("%s: left the previous weight-update group %r", url, group_name)
            except SGLangHTTPError as exc:
                if exc.status == 404 or "not exist" in exc.body or "not found" in exc.body:
                    return
                raise

        await asyncio.gather(*(one(u) for u in self.client.live_workers()))

    # ------------------------------------------------------------------ engine TP size
    async def server_tp_sizes(self) -> dict[str, int | None]:
        """Each worker's `tp_size` from GET /server_info (cached; None where the server does not report it)."""

        from mcore_rl.rollout.sglang.transport import SGLangHTTPError

        async def one(url: str) -> int | None:
            try:
                info = await self.client.request("GET", url, "/server_info", None)
            except SGLangHTTPError as exc:  # a server without it: its TP size is unknown, not wrong
                log.warning("%s/server_info: %s; its engine TP size is not checked", url, str(exc)[:200])
                return None
            tp = info.get("tp_size") if isinstance(info, dict) else None
            return tp if isinstance(tp, int) and not isinstance(tp, bool) and tp > 0 else None

        todo = [u for u in self.client.cfg.worker_urls if u not in self.tp_sizes]
        for url, tp in zip(todo, await asyncio.gather(*(one(u) for u in todo))):
            self.tp_sizes[url] = tp
        return {u: self.tp_sizes[u] for u in self.client.cfg.worker_urls}

    async def resolve_tp_size(self, configured: int | None) -> int:
        """The engine TP size of every worker: the servers' value; a configured one must agree (one-line error)."""
        sizes = await self.server_tp_sizes()
        check_tp_sizes(sizes, dict.fromkeys(sizes, configured))
        known = {tp for tp in sizes.values() if tp is not None}
        if configured is not None:
            return int(configured)
        if len(known) > 1:
            raise ConfigError(f"rollout.worker_urls: the servers run different tp_size {sizes} (GET /server_info); "
                              "weight sync needs one engine TP size")  # fmt: skip
        return known.pop() if known else 1


def check_tp_sizes(served: dict[str, int | None], expected: dict[str, Any]) -> None:
    """One line naming the worker and both values when a server's TP size is not the one the trainer uses."""
    for url, tp in served.items():
        want = expected.get(url)
        if tp is not None and want is not None and int(want) != tp:
            raise ConfigError(f"rollout.tp_size={want} but worker {url} runs tp_size={tp} (GET /server_info); "
                              f"set rollout.tp_size={tp} or leave it unset")  # fmt: skip


class WeightUpdateCalls:
    """The client's weight-update calls (a mixin of AsyncSGLangClient: uses its request/post_all, cfg, interrupts,
    sessions, weight_version)."""

    async def _interrupting(self, coro) -> Any:
        """Run a weight update; in interrupt mode hold new sends until every worker has answered it."""
        self.interrupts.begin()
        try:
            return await coro
        finally:
            self.interrupts.end()

    async def begin_update(self) -> None:
        """From another thread, around a bucketed (tensor/nccl) update: the interrupt gate lives in this loop, and
        every worker gets an SGLang weight-update session (weight_session.py)."""
        self.interrupts.begin()
        try:
            await self.sessions.begin()
        except BaseException:
            self.interrupts.end()
            raise

    async def end_update(self) -> None:
        """Close the sessions (also after a failed update: then that failure is what the caller sees)."""
        try:
            await self.sessions.end()
        finally:
            self.interrupts.end()

    async def update_weights_from_disk(self, path: str, version: int, urls: list[str] | None = None) -> None:
        """Every worker (or only `urls`) loads the folder and tags later tokens with `version`."""
        payload = {"model_path": str(path), "weight_version": str(version), "flush_cache": True}
        if urls is None:
            payload.update(self.interrupts.payload())
            results = await self._interrupting(self.post_all("/update_weights_from_disk", payload))
        else:
            replies = await asyncio.gather(*(self.request("POST", u, "/update_weights_from_disk", payload)
                                             for u in urls))  # fmt: skip
            results = dict(zip(urls, replies))
        for url, res in results.items():
            if isinstance(res, dict) and res.get("success") is False:
                raise RuntimeError(f"{url}/update_weights_from_disk failed: {res.get('message')}")
        self.weight_version = int(version)

    async def update_weight_version(self, version: int, abort_all_requests: bool = False) -> None:
        payload = {
            "new_version": str(version),
            "abort_all_requests": abort_all_requests or self.interrupts.enabled,
        }
        await self._interrupting(self.post_all("/update_weight_version", payload))
        self.weight_version = int(version)

    async def update_weights_from_tensor(self, url: str, payload: dict) -> None:
        """One bucket to one worker: one payload per engine TP rank (checked against its /server_info)."""
        try:
            count = len(payload.get("serialized_named_tensors") or [])
            check_tp_sizes({url: (await self.sessions.server_tp_sizes()).get(url)}, {url: count})
            res = await self.request("POST", url, "/update_weights_from_tensor", payload)
            if isinstance(res, dict) and res.get("success") is False:
                raise RuntimeError(f"{url}/update_weights_from_tensor failed: {res.get('message')}")
        except BaseException as exc:
            self.sessions.failed(exc)
            raise

    async def init_weights_update_group(
        self, master_address: str, master_port: int, tp_sizes: list[int], group_name: str, backend: str
    ) -> None:
        """Tell worker i to join as ranks [1 + sum(tp[:i]), ...) of a group whose rank 0 is the trainer.

        First each worker leaves a group of that name (a previous trainer's), and each worker's TP size must be
        the one the world size counts (a wrong one hangs the rendezvous)."""
        check_tp_sizes(await self.sessions.server_tp_sizes(), dict(zip(self.cfg.worker_urls, tp_sizes)))
        await self.sessions.destroy_group(group_name)
        world = 1 + sum(tp_sizes)
        offsets = list(itertools.accumulate([1, *tp_sizes[:-1]]))
        await asyncio.gather(
            *(
                self.request(
                    "POST", url, "/init_weights_update_group",
                    init_group_payload(master_address, master_port, off, world, group_name, backend),
                )
                for url, off in zip(self.cfg.worker_urls, offsets)
            )
        )  # fmt: skip

    async def update_weights_from_distributed(self, payload: dict) -> None:
        try:
            await self.post_all("/update_weights_from_distributed", payload)
        except BaseException as exc:
            self.sessions.failed(exc)
            raise
