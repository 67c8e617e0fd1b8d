"""One registry type for every pluggable part (algorithms, schedules, old-logit sources, engines, transports,
rewards, data kinds, model families, environments).

Why one: each part used to load its implementations its own way, with name tuples copied between the loader and
the config checks and imports that existed only to register. Here a registry knows, without importing anything,
which module provides each built-in name (so a config choice is validated against its keys before anything heavy
is built), imports that module only when the name is first asked for, and accepts entries registered by user code
beside the built-ins: `@REGISTRY.register("mine")` in a plugin module (mcore_rl/plugins.py, docs/plugins.md), or a
`module:attr` name that points at the object itself.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

from mcore_rl import plugins

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
        self._origin: dict[str, str] = {}  # a name that is not a built-in -> the module whose code registered it

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: make `obj` available as `name`. Registering a name twice with different objects is an error
        (two modules claiming one config choice would make the winner depend on import order)."""

        def deco(obj: T) -> T:
            old = self._entries.get(name)
            if old is not None and old is not obj:
                raise ValueError(f"{self.kind} {name!r} is already registered by {_describe(old)}")
            self._entries[name] = obj
            module = _caller_module()
            if name not in self._modules and module.split(".")[0] != "mcore_rl":  # user code: a plugin's name
                self._note(name, module)
            return obj

        return deco

    def add(self, name: str, obj: T) -> T:
        """Register `obj` as `name` (non-decorator form)."""
        return self.register(name)(obj)

    def names(self) -> list[str]:
        """Every known name, built-in or registered, without importing anything."""
        return sorted(set(self._modules) | set(self._entries))

    def __contains__(self, name: object) -> bool:
        """Cheap for a known name (no import); an unknown one first gets MCORE_RL_PLUGINS' modules imported, so a
        process that only inherited the list (a worker, mcore-rl-convert) knows the plugins' names too."""
        if self._known(name):
            return True
        plugins.load_env()
        return self._known(name)

    def _known(self, name: object) -> bool:
        return name in self._modules or name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def check(self, name: str) -> str:
        """`name` if known, else a one-line RegistryError listing the choices. Cheap for a known name (no import);
        an unknown one first gets the plugins MCORE_RL_PLUGINS names imported (a child process learns the user's
        names there), and a `module:attr` name is resolved by importing its module."""
        if self._known(name):
            return name
        if isinstance(name, str) and ":" in name:
            self._resolve_path(name)
            return name
        if name not in self:  # after MCORE_RL_PLUGINS' modules
            raise RegistryError(f"{self.kind}={name!r}: expected one of {self._choices()}")
        return name

    def _note(self, name: str, module: str) -> None:
        self._origin[name] = module
        plugins.record(module, self.kind, name)

    def _choices(self) -> str:
        """The names, then those of the loaded plugins (`module:attr` names included), each with its plugin."""
        owners = {n: m if ":" in n else plugins.owner(m) for n, m in self._origin.items()}
        own = [n for n in self.names() if owners.get(n) is None]
        theirs = [f"{n} ({owners[n]})" for n in self.names() if owners.get(n) is not None]
        return ", ".join(own) + (f"; from plugins: {', '.join(theirs)}" if theirs else "")

    def _resolve_path(self, path: str) -> None:
        """`module:attr` -> the object itself (an Environment subclass, a reward builder, an Algorithm class), or
        the entry its module registered that holds it (a loader decorated with `@register_dataset`). Registered
        under `path`, so every later lookup of the same name is a dict hit."""
        module, _, attr = path.partition(":")
        try:
            obj = plugins.import_module(module, what=f"{self.kind}={path!r}:")
        except plugins.PluginError as e:
            raise RegistryError(str(e)) from None
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise RegistryError(f"{self.kind}={path!r}: module {module} has no attribute {attr}")
            obj = getattr(obj, part)
        holder = next((e for e in self._entries.values() if e is obj or _holds(e, obj)), obj)
        self._entries[path] = holder
        self._note(path, module)

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


def _caller_module() -> str:
    """The module whose code is registering: the first frame that is a module body or is outside mcore_rl (a
    plugin's decorator line, past the `register_*` helpers it goes through)."""
    frame = sys._getframe(1)
    while frame.f_back is not None:
        name = frame.f_globals.get("__name__", "")
        if frame.f_code.co_name == "<module>" or (name != "mcore_rl" and not name.startswith("mcore_rl.")):
            return name
        frame = frame.f_back
    return frame.f_globals.get("__name__", "")


def _holds(entry: object, obj: object) -> bool:
    """Whether `obj` is one of `entry`'s fields (a registry whose entries wrap the decorated object, e.g. a data
    kind's loader); classes are entries themselves, never holders."""
    return not isinstance(entry, type) and any(v is obj for v in getattr(entry, "__dict__", {}).values())


def _describe(obj: object) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__name__
