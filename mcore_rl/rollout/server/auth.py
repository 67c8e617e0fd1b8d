"""API-key auth of `mcore-rl-serve`, as SGLang's --api-key does it: `Authorization: Bearer <key>` on every path
but the health probes and metrics. Where the key comes from: --api-key (SGLang's flag, public in `ps`), else
--api-key-file (mode 600, read by mcore_rl.api_key), else $MCORE_RL_API_KEY (what the launcher sets)."""

from __future__ import annotations

import argparse

from aiohttp import web

from mcore_rl.api_key import API_KEY_ENV, has_bearer, resolve_api_key
from mcore_rl.rollout.server.state import STATE

# SGLang leaves these open with --api-key (load balancers and the router probe them without credentials)
OPEN_PATHS = ("/health", "/metrics")


@web.middleware
async def auth(request: web.Request, handler) -> web.StreamResponse:
    """`Authorization: Bearer <key>` on every path but /health* and /metrics, as SGLang's --api-key does."""
    key = request.app[STATE].api_key
    if key and not request.path.startswith(OPEN_PATHS):
        if not has_bearer(request.headers, key):
            return web.json_response({"error": "Unauthorized"}, status=401)
    return await handler(request)


def server_api_key(args: argparse.Namespace) -> str | None:
    """The key from the command line's --api-key / --api-key-file, else the launcher's environment variable."""
    return resolve_api_key(
        key=args.api_key, file=args.api_key_file, env=API_KEY_ENV, env_required=False, where="--api-key-file"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", default=None, help=f"prefer --api-key-file or ${API_KEY_ENV}: argv is public")
    p.add_argument("--api-key-file", default=None, help="file holding the key, mode 600")
