"""`mcore-rl-serve`: an SGLang-compatible HTTP server over the local engine (app: routes, codec: wire format)."""

from mcore_rl.rollout.server.app import main

__all__ = ["main"]
