"""The one registry type: lazy import by module path, names known without importing, one-line unknown-name errors."""

from __future__ import annotations

import sys

import pytest

from mcore_rl.registry import Registry, RegistryError


def test_lazy_import_and_choices(tmp_path, monkeypatch):
    mod = tmp_path / "reg_plugin_mod.py"
    mod.write_text("from tests.core.test_registry import REG\n@REG.register('lazy')\nclass Lazy:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "reg_plugin_mod" not in sys.modules
    assert REG.names() == ["eager", "lazy"] and "lazy" in REG
    assert "reg_plugin_mod" not in sys.modules  # names and membership import nothing
    assert REG.get("lazy").__name__ == "Lazy" and "reg_plugin_mod" in sys.modules
    with pytest.raises(RegistryError) as e:
        REG.get("lazzy")
    assert str(e.value) == "thing='lazzy': expected one of eager, lazy"


def test_double_registration_refused():
    reg: Registry[object] = Registry("thing")
    reg.add("a", int)
    reg.add("a", int)  # the same object again (a module imported twice): fine
    with pytest.raises(ValueError, match="already registered by int"):
        reg.add("a", float)


def test_module_that_does_not_register(tmp_path, monkeypatch):
    (tmp_path / "reg_empty_mod.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg: Registry[object] = Registry("thing", {"ghost": "reg_empty_mod"})
    with pytest.raises(RegistryError, match="reg_empty_mod did not register it"):
        reg.get("ghost")


REG: Registry[type] = Registry("thing", {"lazy": "reg_plugin_mod"})
REG.add("eager", object)
