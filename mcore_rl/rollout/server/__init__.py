"""`mcore-rl-serve`: an SGLang-compatible HTTP server over the local engine (app: routes, control: abort/pause/memory, auth, codec: wire format, cli)."""

from mcore_rl.rollout.server.cli import main

__all__ = ["main"]
