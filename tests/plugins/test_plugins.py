"""mcore_rl/plugins.py and the registry's side of plugins, in process with a registry and modules of the test's
own: loading and its one-line failures, MCORE_RL_PLUGINS (read and exported), what each plugin registered,
`module:attr` names, unknown names listing the plugins' names, and the override pre-scan train.py runs before
Hydra composes."""

from __future__ import annotations

import os
import sys

import pytest

from mcore_rl import plugins
from mcore_rl.registry import Registry, RegistryError

THINGS: Registry[object] = Registry("thing", {"builtin": "json"})


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """Modules `tp_things` (registers `alpha` in THINGS, defines `Beta`), `tp_holder` (registers an entry that holds
    a function), `tp_broken` (raises on import), on sys.path; plugins' state and MCORE_RL_PLUGINS restored after."""
    files = {
        "tp_things.py": "from tests.plugins.test_plugins import THINGS\n@THINGS.register('alpha')\nclass Alpha:\n"
                        "    pass\nclass Beta:\n    pass\n",
        "tp_holder.py": "from types import SimpleNamespace\nfrom tests.plugins.test_plugins import THINGS\n"
                        "def load():\n    return 1\nTHINGS.add('gamma', SimpleNamespace(load=load))\n",
        "tp_broken.py": "import math\nmath.sqrt(-1)\n",
    }  # fmt: skip
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(plugins.ENV, "")  # (delenv of an unset variable would not undo what the tests export)
    state = list(plugins._loaded), list(plugins._registered)
    entries, origin = dict(THINGS._entries), dict(THINGS._origin)
    yield tmp_path
    plugins._loaded[:], plugins._registered[:] = state
    THINGS._entries, THINGS._origin = entries, origin
    for name in files:
        sys.modules.pop(name.removesuffix(".py"), None)


def test_load_records_what_each_plugin_registered_and_exports_the_list(user_modules):
    assert plugins.load(["tp_things", " tp_holder", "tp_things"]) == ["tp_things", "tp_holder"]
    assert plugins.load("tp_things,tp_holder") == []  # loaded once
    assert os.environ[plugins.ENV] == "tp_things,tp_holder"  # children inherit them
    assert plugins.summary() == "plugins: tp_things (thing: alpha), tp_holder (thing: gamma)"
    assert plugins.summary(["tp_holder", "not_loaded"]) == "plugins: tp_holder (thing: gamma)"
    assert plugins.owner("tp_things") == "tp_things" and plugins.owner("json") is None


def test_a_module_imported_before_its_plugin_load_is_still_credited(user_modules):
    import tp_things  # noqa: F401  (imported by other code first)

    plugins.load(["tp_things"], export=False)
    assert plugins.summary() == "plugins: tp_things (thing: alpha)"
    assert os.environ[plugins.ENV] == ""


@pytest.mark.parametrize("module, line", [
    ("tp_broken", "plugin tp_broken: import failed: ValueError: math domain error"),
    ("tp_missing", "plugin tp_missing: import failed: ModuleNotFoundError: No module named 'tp_missing'"),
    ("tp-things", "plugin 'tp-things' is not a module name (a dotted path such as my_pkg.envs)"),
])  # fmt: skip
def test_a_plugin_that_fails_is_one_line_naming_the_module(user_modules, module, line):
    with pytest.raises(plugins.PluginError) as e:
        plugins.load(["tp_things", module])
    assert str(e.value) == line and isinstance(e.value, ValueError)
    assert plugins.loaded() == ["tp_things"] and os.environ[plugins.ENV] == ""


def test_unknown_names_load_the_env_plugins_then_list_builtin_and_plugin_names(user_modules, monkeypatch):
    monkeypatch.setenv(plugins.ENV, "tp_things")  # a child process: the list came in the environment
    assert THINGS.check("alpha") == "alpha" and "tp_things" in sys.modules
    with pytest.raises(RegistryError) as e:
        THINGS.check("alpah")
    assert str(e.value) == "thing='alpah': expected one of builtin; from plugins: alpha (tp_things)"


def test_module_attr_names(user_modules):
    assert THINGS.get("tp_things:Beta").__name__ == "Beta"  # the object itself
    # an object its module registered inside an entry: the entry (a data kind's loader -> its DataKind)
    assert THINGS.get("tp_holder:load").load() == 1 and THINGS.get("tp_holder:load") is THINGS.get("gamma")
    assert THINGS.get("tp_things:Alpha") is THINGS.get("alpha")
    with pytest.raises(RegistryError, match=r"^thing='tp_things:Gamma': module tp_things has no attribute Gamma$"):
        THINGS.check("tp_things:Gamma")
    with pytest.raises(RegistryError) as e:
        THINGS.check("tp_broken:f")
    assert str(e.value) == "thing='tp_broken:f': tp_broken: import failed: ValueError: math domain error"
    with pytest.raises(RegistryError) as e:
        THINGS.check("nope")
    assert str(e.value).endswith("from plugins: tp_holder:load (tp_holder), tp_things:Alpha (tp_things), "
                                 "tp_things:Beta (tp_things)")


def test_plugins_in_overrides_before_hydra_composes():
    from mcore_rl.train import plugins_in_overrides

    args = ["model=tiny", "plugins=[a.b,c]", "+plugins=[d]", "plugins_x=1", "--cfg", "plugins=e", "plugins=[f],[g,h]"]
    assert plugins_in_overrides(args) == ["a.b", "c", "d", "e", "f", "g", "h"]
