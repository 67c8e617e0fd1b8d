"""An aiohttp app served on 127.0.0.1 (a free port) from a thread of its own, for the reward tests' stand-in
services (rm_server.py, stand_in.py): the test's own thread stays free to drive the trainer's client."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable


class ThreadedApp:
    """`start({path: handler})` serves POST routes and returns the port; `stop()` tears the app down."""

    def start(self, routes: dict[str, Callable[..., Awaitable]]) -> int:
        from aiohttp import web

        self._loop = asyncio.new_event_loop()
        app = web.Application()
        for path, handler in routes.items():
            app.router.add_post(path, handler)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        return self._runner.addresses[0][1]

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=20)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
