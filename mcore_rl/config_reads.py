"""Which typed config fields a run actually reads (for tests/config/test_keys_read.py).

With `MCORE_RL_CONFIG_READS=<dir>` in the environment, importing mcore_rl.train (every CLI run and torchrun rank) patches `__getattribute__` of
every config dataclass so that each field read by running code is recorded once per process as a line
`module.Class.field` in `<dir>/reads-<pid>.txt`, written as it happens (a killed process keeps what it read).
Child processes inherit the variable, so torchrun ranks and launched servers record too. Without the variable
nothing is patched.

Not counted as reads: the declaring class's own validation (its `__post_init__` and what that calls; a subclass's
`__post_init__` acting on an inherited field counts), the generated `__repr__` /
`__eq__`, and copies made by dataclasses, copy, OmegaConf and Hydra (e.g. writing run.dir/config.yaml), and test
code: a field counts only when product code looks at it. A field declared on a base class is recorded on the
class that declares it, whichever subclass was read.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

ENV = "MCORE_RL_CONFIG_READS"
_NOT_READS = (
    "dataclasses",
    "copy",
    "omegaconf",
    "hydra",
    "tests",
)  # top-level packages of non-reading callers
_lock = threading.Lock()
_seen: set[str] = set()
_patched: set[type] = set()


def key(cls: type, name: str) -> str:
    return f"{cls.__module__}.{cls.__qualname__}.{name}"


def declaring_class(cls: type, name: str) -> type:
    """The most basic class in `cls`'s MRO that declares the field `name`."""
    for base in reversed(cls.__mro__):
        if name in base.__dict__.get("__annotations__", {}):
            return base
    return cls


def _counts(frame, owner: type) -> bool:
    """False for reads by `owner`'s own validation (its `__post_init__` and what that calls; a subclass acting on
    an inherited field in its `__post_init__` is a use), dataclass/OmegaConf machinery or tests."""
    caller = frame.f_globals.get("__name__", "")
    if caller.split(".")[0] in _NOT_READS or caller == __name__:
        return False
    for _ in range(4):  # validation helpers called from __post_init__
        if frame is None:
            break
        code = frame.f_code
        if code.co_name in ("__repr__", "__eq__"):
            return False
        if code.co_name == "__post_init__" and code.co_qualname.split(".")[-2:-1] in (
            [owner.__qualname__],
            [],
        ):
            return False
        frame = frame.f_back
    return True


def _record(line: str, out_dir: Path) -> None:
    with _lock:
        if line in _seen:
            return
        _seen.add(line)
        with (out_dir / f"reads-{os.getpid()}.txt").open("a") as f:
            f.write(line + "\n")


def patch(classes: Iterable[type], out_dir: Path) -> None:
    """Record field reads on `classes` (dataclasses) into `out_dir` (idempotent per class)."""
    for cls in classes:
        if cls in _patched or not dataclasses.is_dataclass(cls):
            continue
        names = frozenset(f.name for f in dataclasses.fields(cls))
        original = cls.__getattribute__

        def getattribute(self, name, _names=names, _original=original, _cls=cls):
            # a patched subclass records through its own wrapper (this one then runs as its `_original`)
            mine = type(self) is _cls or type(self) not in _patched
            if name in _names and mine:
                owner = declaring_class(_cls, name)
                if _counts(sys._getframe(1), owner):
                    _record(key(owner, name), out_dir)
            return _original(self, name)

        cls.__getattribute__ = getattribute
        _patched.add(cls)


def config_classes() -> list[type]:
    """Every typed config dataclass: the root's groups (nested ones included), each rollout engine's and each
    algorithm's schema, each data kind's and each reward's settings."""
    from mcore_rl.algorithms import config_class, registered_algorithms
    from mcore_rl.config import ROLLOUT_SCHEMAS, MainConfig
    from mcore_rl.data.registry import DATASETS
    from mcore_rl.envs.base import ENVS
    from mcore_rl.rewards.registry import REWARDS, reward_config_class

    roots = [
        MainConfig,
        *ROLLOUT_SCHEMAS.values(),
        *(config_class(n) for n in registered_algorithms()),
        *(k.config for k in DATASETS.values()),
        *(c for c in map(reward_config_class, REWARDS.names()) if c is not None),
        *(ENVS.get(n).config_cls for n in ENVS.names()),
    ]
    out: list[type] = []
    while roots:
        cls = roots.pop()
        if cls in out or not dataclasses.is_dataclass(cls):
            continue
        out.append(cls)
        roots.extend(_nested(cls))
    return out


def _nested(cls: type) -> list[type]:
    import typing

    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        for t in (hint, *typing.get_args(hint)):
            if isinstance(t, type) and dataclasses.is_dataclass(t):
                found.append(t)
    return found


def install_from_env() -> Path | None:
    """Patch every config class when MCORE_RL_CONFIG_READS names a folder; returns it (None: off)."""
    where = os.environ.get(ENV)
    if not where:
        return None
    out_dir = Path(where)
    out_dir.mkdir(parents=True, exist_ok=True)
    patch(config_classes(), out_dir)
    return out_dir


def read_keys(out_dir: Path) -> dict[str, set[int]]:
    """Every recorded `module.Class.field` -> the pids that read it."""
    got: dict[str, set[int]] = {}
    for path in out_dir.glob("reads-*.txt"):
        pid = int(path.stem.split("-")[1])
        for line in path.read_text().splitlines():
            if line.strip():
                got.setdefault(line.strip(), set()).add(pid)
    return got
