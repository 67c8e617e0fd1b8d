"""One registry type for every pluggable part (algorithms, schedules, old-logit sources, engines, transports,
rewards, data kinds, model families, environments).

Why one: each part used to load its implementations its own way, with name tuples copied between the loader and
the config checks and imports that existed only to register. Here a registry knows, without importing anything,
which module provides each built-in name (so a config choice is validated against its keys before anything heavy
is built), imports that module only when the name is first asked for, and accepts entries registered by user code
(`@REGISTRY.register("mine")` in a module the user imports) beside the built-ins.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class RegistryError(KeyError, ValueError):
    """An unknown name; its message is the one line a user sees (`str()` of a KeyError would add quotes).

    Both a KeyError (a failed lookup) and a ValueError (a bad config value): config validation turns ValueErrors
    into one-line config errors, so an unknown choice exits like any other bad setting."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """`kind` names the config key the choice comes from (for messages); `modules` maps each built-in name to the
    module whose import registers it."""

    def __init__(self, kind: str, modules: Mapping[str, str] | None = None) -> None:
        self.kind = kind
        self._modules: dict[str, str] = dict(modules or {})
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: make `obj` available as `name`. Registering a name twice with different objects is an error
        (two modules claiming one config choice would make the winner depend on import order)."""

        def deco(obj: T) -> T:
            old = self._entries.get(name)
            if old is not None and old is not obj:
                raise ValueError(f"{self.kind} {name!r} is already registered by {_describe(old)}")
            self._entries[name] = obj
            return obj

        return deco

    def add(self, name: str, obj: T) -> T:
        """Register `obj` as `name` (non-decorator form)."""
        return self.register(name)(obj)

    def names(self) -> list[str]:
        """Every known name, built-in or registered, without importing anything."""
        return sorted(set(self._modules) | set(self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self._modules or name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def check(self, name: str) -> str:
        """`name` if known, else a one-line RegistryError listing the choices (cheap: no import)."""
        if name not in self:
            raise RegistryError(f"{self.kind}={name!r}: expected one of {', '.join(self.names())}")
        return name

    def get(self, name: str) -> T:
        """The entry for `name`, importing its module on first use."""
        self.check(name)
        if name not in self._entries:
            importlib.import_module(self._modules[name])
            if name not in self._entries:
                raise RegistryError(f"{self.kind}={name!r}: module {self._modules[name]} did not register it")
        return self._entries[name]

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __len__(self) -> int:
        return len(self.names())

    def values(self) -> list[T]:
        """Every entry, in name order (imports every built-in module)."""
        return list(self.load_all().values())

    def load_all(self) -> dict[str, T]:
        """Every entry (imports every built-in module): for listings such as Hydra's schema store."""
        return {name: self.get(name) for name in self.names()}


def _describe(obj: object) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__name__
