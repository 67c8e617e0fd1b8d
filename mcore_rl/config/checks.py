"""The one error type for bad settings and the small checks every config group's `__post_init__` uses.

Messages are one line and name the full key (`trainer.steps=-1 must be >= 0`): the CLI prints them as
`config error: ...` and exits 2, before any model is built.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """A bad setting, reported in one line that names the field."""


def positive(key: str, value: Any, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value!r} must be {'>= 0' if allow_zero else '> 0'}")


def one_of(key: str, value: Any, choices: Iterable[Any]) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise ConfigError(f"{key}={value!r}: expected one of {', '.join(map(str, choices))}")
