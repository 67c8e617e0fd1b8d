"""Checks and derived settings for SGLang rollout, run before anything heavy is built.

Why a module of its own: the trainer asks two questions before it starts servers -- can this machine start
them at all (SGLang installed, or servers already running elsewhere), and must they sample reproducibly
(trainer.deterministic) -- and both answers are about the engine's options, not about the training loop.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'mcore-rl[gpu]'"
# launcher.server / launcher.router -> the Python module it runs (`{python} -m <module>`)
SERVER_MODULES = {"sglang": "sglang"}
ROUTER_MODULE = "sglang_router"


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def missing_server(rollout: Mapping[str, Any]) -> str | None:
    """One line naming what to install when `rollout` would launch SGLang (or its router) here and cannot;
    None when nothing is launched here (rollout.worker_urls given, a CPU stand-in server) or it is installed."""
    if rollout.get("engine") != "sglang" or rollout.get("worker_urls"):
        return None
    launcher = rollout.get("launcher") or {}
    module = SERVER_MODULES.get(launcher.get("server", "sglang"))
    if module is not None and not _installed(module):
        return (
            f"rollout=sglang needs SGLang on this machine: {INSTALL_HINT} "
            "(or set rollout.worker_urls to running servers)"
        )
    if launcher.get("router") and not _installed(ROUTER_MODULE):
        return (
            f"rollout.launcher.router=true needs sglang-router on this machine: {INSTALL_HINT} "
            "(or set rollout.router_url to a running router)"
        )
    return None


def engine_determinism(options: dict[str, Any], trainer_deterministic: bool) -> dict[str, Any]:
    """A deterministic run needs reproducible samples: SGLang honours sampling_seed only with
    --enable-deterministic-inference, so trainer.deterministic=true turns rollout.deterministic on."""
    if trainer_deterministic and "deterministic" in options and not options["deterministic"]:
        log.warning(
            "trainer.deterministic=true: rollout.deterministic on (SGLang's batch-invariant kernels, "
            "slower); set trainer.deterministic=false for throughput"
        )
        options = {**options, "deterministic": True}
    return options
