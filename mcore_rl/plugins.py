"""Plugins: the user's own modules, imported before any name is resolved, in every process that resolves one.

Why: in RL post-training the task is the user's code (an environment, a reward, a data loader, an algorithm, a model
family). A registry knows its built-in names from a table, but a user's names exist only once the module that
registers them has been imported, and no mcore-rl command imports user code by itself. A plugin is such a module,
named in the config's top-level `plugins: [my_pkg.envs, my_pkg.rewards]`, on the command line, or in the
environment variable `MCORE_RL_PLUGINS` (comma-separated). Importing it runs its `@register_...` decorators.

Why an environment variable as well as the config: names are resolved in processes that never see the config
(reward and tool workers, the multiprocessing forkserver, a torchrun rank before it has composed its config). So
the CLI writes the run's list into `MCORE_RL_PLUGINS`, its children inherit it, and a registry asked for a name it
does not know imports the variable's modules before calling the name unknown (registry.py). The variable also lets
a user name their plugins once for every command.

This module imports nothing of mcore_rl (layer 0): registry.py reports each registration of a name that is not a
built-in here, with the module whose code registered it, so the start-up line can say what each plugin registered
(`plugins: my_pkg.envs (env: guess)`) however the module came to be imported first.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Iterable

ENV = "MCORE_RL_PLUGINS"
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")

_loaded: list[str] = []  # plugin modules imported by load(), in order
_registered: list[tuple[str, str, str]] = []  # (module whose code registered it, registry kind, name)


class PluginError(ValueError):
    """A plugin that cannot be loaded; the message is the one line a user sees (naming the module and the error).
    A ValueError, so config validation reports it like any other bad setting (exit 2)."""


def parse(value: str | Iterable[str] | None) -> list[str]:
    """Module names from a comma-separated string or a list, stripped, empty entries and repeats dropped."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else [str(v) for v in value]
    out: list[str] = []
    for item in (i.strip() for i in items):
        if item and item not in out:
            out.append(item)
    return out


def from_env() -> list[str]:
    return parse(os.environ.get(ENV))


def import_module(module: str, what: str = "plugin"):
    """Import `module` (a plugin, or the module of a `module:attr` name); a failure is one PluginError line that
    names the module and the exception, whatever the module's code raised."""
    if not _MODULE.match(module):
        raise PluginError(f"{what} {module!r} is not a module name (a dotted path such as my_pkg.envs)")
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any error in user code is reported in one line, not a traceback
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise PluginError(f"{what} {module}: import failed: {type(e).__name__}{': ' + detail if detail else ''}") \
            from e


def load(modules: str | Iterable[str] | None, export: bool = True) -> list[str]:
    """Import each module of `modules` not yet loaded; returns the ones imported now. With `export`, `modules` are
    added to MCORE_RL_PLUGINS so that the child processes load them too."""
    new = [m for m in parse(modules) if m not in _loaded]
    for module in new:
        import_module(module)
        _loaded.append(module)
    if export:
        export_env(modules)
    return new


def load_env() -> list[str]:
    """Import the modules MCORE_RL_PLUGINS names (a child process, or a user who set it once); cheap when done."""
    return load(from_env(), export=False)


def export_env(modules: str | Iterable[str] | None) -> None:
    """Add `modules` to MCORE_RL_PLUGINS, so that every process this one starts from now on imports them too."""
    every = parse([*from_env(), *parse(modules)])
    if every:
        os.environ[ENV] = ",".join(every)


def loaded() -> list[str]:
    return list(_loaded)


def record(module: str, kind: str, name: str) -> None:
    """Called by registry.py for every name registered that is not a built-in: `module` is the code's module."""
    _registered.append((module, kind, name))


def _owns(plugin: str, module: str) -> bool:
    return module == plugin or module.startswith(plugin + ".")


def owner(module: str) -> str | None:
    """The loaded plugin that `module` is (or is a submodule of), None for code that is not a plugin."""
    return next((p for p in _loaded if _owns(p, module)), None)


def summary(modules: str | Iterable[str] | None = None) -> str:
    """`plugins: my_pkg.envs (env: guess), my_pkg.data (data.kind: words)` for `modules` (default: every plugin
    loaded), in their order; '' when there is none. A module's names are those its code (or its submodules')
    registered, `module:attr` names included."""
    chosen = [m for m in (parse(modules) if modules is not None else _loaded) if m in _loaded]
    parts = []
    for plugin in chosen:
        by_kind: dict[str, list[str]] = {}
        for module, kind, name in _registered:
            if _owns(plugin, module) and name not in by_kind.setdefault(kind, []):
                by_kind[kind].append(name)
        what = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in by_kind.items() if names)
        parts.append(f"{plugin} ({what or 'registered nothing'})")
    return "plugins: " + ", ".join(parts) if parts else ""
