"""Typed configs: one dataclass per Hydra config group, registered with Hydra's ConfigStore as its schema.

Hydra composes hydra_conf/config.yaml on top of `MainConfig` (its defaults list starts with `mcore_rl_schema`),
so an override of a key no dataclass declares fails at composition (`mcore-rl-train trainer.stpes=3` ->
`config error: ... 'stpes' ...`, exit 2), and a yaml may leave out any key whose default it keeps. Groups whose
schema depends on the chosen entry name it in their own defaults list: `rollout/<engine>.yaml` ->
`/schema/rollout/<engine>`, `algorithm/<x>.yaml` -> `/schema/algorithm/<name>` (the algorithm's registered
dataclass). `data` and `reward` stay plain dicts at composition: their builders validate them against the
dataclass of the chosen kind (data/registry.py, rewards/registry.py) and name an unknown key in one line.

Adding a key: declare the field (with its default and a comment) on the group's dataclass here, read it where it
acts, set it through the CLI in a test (tests/config/test_cli_keys.py), and document it in docs/config.md.
tests/config/ fails on a yaml key no dataclass declares and on a declared field no code reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mcore_rl.config.checks import ConfigError
from mcore_rl.config.evaluation import EvalConfig
from mcore_rl.config.logs import LoggingConfig
from mcore_rl.config.model import Fp8Config, LoadCheckConfig, ModelConfig, MoeConfig
from mcore_rl.config.optim import OptimSettings
from mcore_rl.config.parallel import ParallelConfig
from mcore_rl.config.rollout import LocalRolloutConfig, SGLangLauncherSettings, SGLangRolloutConfig
from mcore_rl.config.run import RunConfig
from mcore_rl.config.trainer import TrainerConfig

ROOT_SCHEMA = "mcore_rl_schema"
# rollout.engine -> its schema (stored as /schema/rollout/<engine>)
ROLLOUT_SCHEMAS: dict[str, type] = {"local": LocalRolloutConfig, "sglang": SGLangRolloutConfig}


@dataclass
class MainConfig:
    """The root: typed groups, plus the groups validated by their own registries (algorithm, data, reward)."""

    seed: int = 1234
    run: RunConfig = field(default_factory=RunConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimSettings = field(default_factory=OptimSettings)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: Any = None     # typed by /schema/rollout/<engine> from the rollout yaml's defaults list
    algorithm: Any = None   # typed by /schema/algorithm/<name>; built (and validated) by build_algorithm
    data: Any = None        # validated by data/registry.py against the kind's dataclass
    reward: Any = None      # validated by rewards/registry.py against each part's dataclass


_registered = False


def register_configs() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent). Call before composing hydra_conf/ (train.py does;
    code that composes with hydra.compose imports mcore_rl.config first)."""
    global _registered
    if _registered:
        return
    from hydra.core.config_store import ConfigStore

    from mcore_rl.algorithms import config_class, registered_algorithms

    cs = ConfigStore.instance()
    cs.store(name=ROOT_SCHEMA, node=MainConfig)
    for engine, schema in ROLLOUT_SCHEMAS.items():
        cs.store(group="schema/rollout", name=engine, node=schema)
    for name in registered_algorithms():
        cs.store(group="schema/algorithm", name=name, node=config_class(name))
    _registered = True


register_configs()


def _one_line(e: Exception) -> str:
    return str(e).splitlines()[0].strip() if str(e) else type(e).__name__


def typed_group(cfg: DictConfig, key: str, schema: type) -> Any:
    """The group `key` of the composed config as its dataclass instance (runs `__post_init__` validation)."""
    try:
        node = OmegaConf.select(cfg, key)  # resolved in place: interpolations may point anywhere in the root
        node = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else {}
        merged = OmegaConf.merge(OmegaConf.structured(schema), node)
        return OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except OmegaConfBaseException as e:
        if isinstance(e.__cause__, ConfigError):
            raise e.__cause__ from None
        full = getattr(e, "full_key", None)
        raise ConfigError(f"{key}.{full}: {_one_line(e)}" if full else f"{key}: {_one_line(e)}") from None
    except ValueError as e:
        raise ConfigError(_one_line(e)) from None


def rollout_schema(cfg: DictConfig) -> type:
    engine = OmegaConf.select(cfg, "rollout.engine")
    if engine not in ROLLOUT_SCHEMAS:
        raise ConfigError(f"rollout.engine={engine!r}: expected one of {', '.join(ROLLOUT_SCHEMAS)}")
    return ROLLOUT_SCHEMAS[engine]


def algorithm_spec(cfg: DictConfig) -> dict:
    """The algorithm's config dict; `max_response_len: null` means the rollout's own cap, trainer.max_new_tokens."""
    spec = OmegaConf.to_container(cfg.algorithm, resolve=True)
    if spec.get("max_response_len") is None:
        spec["max_response_len"] = int(cfg.trainer.max_new_tokens)
    return spec


def validate(cfg: DictConfig) -> None:
    """Every typed group's `__post_init__` checks plus the algorithm's, as one-line ConfigErrors."""
    known = {f.name for f in fields(MainConfig)}
    stray = sorted(set(cfg.keys()) - known - {"hydra"})
    if stray:
        raise ConfigError(f"unknown top-level key(s) {stray}; known: {sorted(known)}")
    for key, schema in (("trainer", TrainerConfig), ("eval", EvalConfig), ("optim", OptimSettings),
                        ("logging", LoggingConfig), ("model", ModelConfig), ("parallel", ParallelConfig),
                        ("run", RunConfig)):
        typed_group(cfg, key, schema)
    typed_group(cfg, "rollout", rollout_schema(cfg))
    from mcore_rl.algorithms import build_algorithm

    try:
        build_algorithm(algorithm_spec(cfg))
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(str(e).strip("'\"")) from None


__all__ = [
    "ConfigError", "algorithm_spec", "EvalConfig", "Fp8Config", "LoadCheckConfig", "LocalRolloutConfig", "LoggingConfig", "MainConfig",
    "ModelConfig", "MoeConfig", "OptimSettings", "ParallelConfig", "RunConfig", "SGLangLauncherSettings",
    "SGLangRolloutConfig", "TrainerConfig", "register_configs", "rollout_schema", "typed_group", "validate",
]
