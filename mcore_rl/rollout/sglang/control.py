"""Abort, pause/continue, memory and health calls of the SGLang client, each sent to every worker (a router does not
forward them). Aborts by the caller are counted in the interrupt bookkeeping (interrupt.py), so that a sample the
caller aborted is returned as an abort, not generated again like one an interrupting weight update aborted."""

from __future__ import annotations

import asyncio

import aiohttp

from mcore_rl.rollout.protocol import PauseMode
from mcore_rl.rollout.sglang.transport import SGLangHTTPError


class ControlCalls:
    """A mixin of AsyncSGLangClient: uses its request/post_all, cfg, interrupts and in-flight sample rids."""

    async def abort(self, rid: str | None = None) -> None:
        if rid is None:
            self.interrupts.caller_aborts += 1
            await self.post_all("/abort_request", {"rid": "", "abort_all": True})
            return
        subs = sorted(self._inflight.get(rid, ()))
        self.interrupts.caller_aborted.update(subs)
        await asyncio.gather(*(self.post_all("/abort_request", {"rid": s}) for s in subs))

    async def check_abort(self) -> None:
        """Interrupt mode needs workers that abort: each must answer /abort_request (an unknown rid is a no-op in
        SGLang). One line naming the URL otherwise (a router or another server given as a worker URL)."""
        for url in self.cfg.worker_urls:
            try:
                await self.request("POST", url, "/abort_request", {"rid": "mcore-rl-abort-probe"}, retries=0)
            except (SGLangHTTPError, aiohttp.ClientError, TimeoutError) as exc:
                raise RuntimeError(
                    f"rollout.worker_urls: {url} cannot abort requests ({str(exc).splitlines()[0][:200]}); interrupt "
                    "mode (old_logp_source=interrupt|old_logit_model) needs SGLang workers that answer "
                    "/abort_request and honour abort_all_requests (a router does not forward aborts)"
                ) from None

    async def pause(self, mode: PauseMode = "abort") -> None:
        if mode == "abort":
            self.interrupts.caller_aborts += 1
        await self.post_all("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self.post_all("/continue_generation", {})

    async def flush_cache(self) -> None:
        await self.post_all("/flush_cache", {})

    async def release_memory(self, tags: list[str] | None = None) -> None:
        await self.post_all("/release_memory_occupation", {"tags": tags} if tags else {})

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        await self.post_all("/resume_memory_occupation", {"tags": tags} if tags else {})

    async def health(self) -> bool:
        async def one(url: str) -> bool:
            try:
                await self.request("GET", url, "/health", None, timeout=20.0, retries=0)
                return True
            except (TimeoutError, SGLangHTTPError, aiohttp.ClientError):
                return False

        return all(await asyncio.gather(*(one(u) for u in self.cfg.worker_urls)))
