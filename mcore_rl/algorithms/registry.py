"""Name -> Algorithm class registry and config validation.

`build_algorithm(cfg)` accepts the Hydra node `algorithm` (DictConfig) or a plain dict with a `name` key. The
config is checked against the registered class's dataclass: unknown keys and ill-typed values are errors that
name the key and the algorithm, so a typo in a yaml never silently falls back to a default. `ALGORITHMS` knows
each built-in's module without importing it, so only the chosen algorithm's module is loaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mcore_rl.algorithms.base import Algorithm, AlgorithmConfig
from mcore_rl.registry import Registry

_PKG = "mcore_rl.algorithms"
ALGORITHMS: Registry[type[Algorithm]] = Registry("algorithm.name", {
    "grpo": f"{_PKG}.grpo", "dapo": f"{_PKG}.grpo", "dr_grpo": f"{_PKG}.grpo",
    "cispo": f"{_PKG}.cispo", "scalerl": f"{_PKG}.cispo",
    "p3o": f"{_PKG}.p3o", "mu_grpo": f"{_PKG}.mu_grpo", "ppo_ewma": f"{_PKG}.ppo_ewma",
    "rloo": f"{_PKG}.rloo", "reinforce_pp": f"{_PKG}.reinforce_pp",
    "gspo": f"{_PKG}.gspo",
})  # fmt: skip
A = TypeVar("A", bound=type[Algorithm])


def register_algorithm(name: str) -> Callable[[A], A]:
    """Class decorator: make `cls` buildable as `name: <name>`."""

    def deco(cls: A) -> A:
        cls.name = name
        return ALGORITHMS.register(name)(cls)

    return deco


def registered_algorithms() -> list[str]:
    return ALGORITHMS.names()


def algorithm_class(name: str) -> type[Algorithm]:
    return ALGORITHMS.get(name)


def config_class(name: str) -> type[AlgorithmConfig]:
    """The dataclass schema of algorithm `name` (e.g. to register with Hydra's ConfigStore)."""
    return algorithm_class(name).config_cls


def _check_keys(data: Mapping[str, Any], schema: type, algo: str, prefix: str = "") -> None:
    known = {f.name: f for f in dataclasses.fields(schema)}
    for key, value in data.items():
        if key not in known:
            raise ValueError(f"algorithm {algo!r}: unknown config key '{prefix}{key}' "
                             f"(valid keys: {sorted(known)})")
        ftype = known[key].default_factory if known[key].default_factory is not dataclasses.MISSING else None
        if isinstance(ftype, type) and dataclasses.is_dataclass(ftype) and isinstance(value, Mapping):
            _check_keys(value, ftype, algo, f"{prefix}{key}.")


def parse_config(cfg: Mapping[str, Any] | DictConfig | AlgorithmConfig) -> AlgorithmConfig:
    """Validate `cfg` against its algorithm's dataclass and return the typed config object."""
    if isinstance(cfg, AlgorithmConfig):
        algorithm_class(cfg.name)
        return cfg
    if isinstance(cfg, DictConfig):
        data = OmegaConf.to_container(cfg, resolve=True)
    elif isinstance(cfg, Mapping):
        data = OmegaConf.to_container(OmegaConf.create(dict(cfg)), resolve=True)
    else:
        raise TypeError(f"algorithm config must be a dict or DictConfig, got {type(cfg).__name__}")
    name = data.get("name")
    if not name:
        raise ValueError(f"algorithm config has no 'name'; expected one of {', '.join(registered_algorithms())}")
    cls = algorithm_class(name)
    _check_keys(data, cls.config_cls, name)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cls.config_cls), data)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        msg = str(e).splitlines()[0]
        raise ValueError(f"algorithm {name!r}: bad value for '{getattr(e, 'full_key', '?')}': {msg}") from e


def build_algorithm(cfg: Mapping[str, Any] | DictConfig | AlgorithmConfig) -> Algorithm:
    """Build the registered algorithm named by cfg['name'] from a dict / DictConfig / config dataclass."""
    config = parse_config(cfg)
    return algorithm_class(config.name)(config)
