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

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mcore_rl.config.checks import ConfigError
from mcore_rl.config.evaluation import EvalConfig
from mcore_rl.config.logs import LoggingConfig
from mcore_rl.config.model import Fp8Config, LoadCheckConfig, ModelConfig, MoeConfig
from mcore_rl.config.optim import OptimSettings
from mcore_rl.config.parallel import ParallelConfig
from mcore_rl.config.partial import PartialRolloutConfig
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
    partial_rollout: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)  # carried samples
    rollout: Any = None     # LocalRolloutConfig | SGLangRolloutConfig: /schema/rollout/<engine> (rollout yaml)
    algorithm: Any = None   # the algorithm's registered config dataclass: /schema/algorithm/<name>
    data: Any = None        # validated by data/registry.py against the kind's dataclass
    reward: Any = None      # validated by rewards/registry.py against each part's dataclass
    env: Any = None         # env=NAME: episodes instead of single replies; validated by envs.build_environment
    # modules imported before the config is typed, so that their registrations (algorithms, environments, rewards,
    # data kinds, model families) are valid names; MCORE_RL_PLUGINS adds to them (mcore_rl/plugins.py)
    plugins: list[str] = field(default_factory=list)


_stored: set[str] = set()  # what register_configs has put in the ConfigStore


def register_configs() -> None:
    """Store every schema in Hydra's ConfigStore. Call before composing hydra_conf/ (train.py does; code that
    composes with hydra.compose imports mcore_rl.config first). Calling it again stores only what is new: the
    schemas of algorithms that plugins registered since (train.py imports the plugins, then calls it)."""
    from hydra.core.config_store import ConfigStore

    from mcore_rl.algorithms import config_class, registered_algorithms

    cs = ConfigStore.instance()
    if ROOT_SCHEMA not in _stored:
        cs.store(name=ROOT_SCHEMA, node=MainConfig)
        for engine, schema in ROLLOUT_SCHEMAS.items():
            cs.store(group="schema/rollout", name=engine, node=schema)
        _stored.add(ROOT_SCHEMA)
    for name in registered_algorithms():
        if f"algorithm/{name}" not in _stored and ":" not in name:  # a module:attr name has no yaml to name it
            cs.store(group="schema/algorithm", name=name, node=config_class(name))
            _stored.add(f"algorithm/{name}")


register_configs()


def _one_line(e: Exception) -> str:
    return str(e).splitlines()[0].strip() if str(e) else type(e).__name__


def _typed(convert, where: str):
    """Run `convert` (an OmegaConf -> dataclass conversion); its failures become one-line ConfigErrors."""
    try:
        return convert()
    except ConfigError:
        raise
    except OmegaConfBaseException as e:
        if isinstance(e.__cause__, ConfigError):
            raise e.__cause__ from None
        full = getattr(e, "full_key", None)
        raise ConfigError(f"{where}.{full}: {_one_line(e)}" if full and where else
                          f"{full or where}: {_one_line(e)}") from None
    except ValueError as e:
        raise ConfigError(_one_line(e)) from None


def rollout_schema(cfg: DictConfig) -> type:
    engine = OmegaConf.select(cfg, "rollout.engine")
    if engine not in ROLLOUT_SCHEMAS:
        raise ConfigError(f"rollout.engine={engine!r}: expected one of {', '.join(ROLLOUT_SCHEMAS)}")
    return ROLLOUT_SCHEMAS[engine]


def _refuse_undeclared(node: DictConfig, where: str) -> None:
    """A key no schema declares (`+trainer.stpes=3` forces one past Hydra's struct check) is an error."""
    schema = OmegaConf.get_type(node)
    declared = {f.name for f in fields(schema)} if schema is not None and is_dataclass(schema) else None
    for key in node.keys():
        name = f"{where}.{key}" if where else str(key)
        if declared is not None and key not in declared:
            raise ConfigError(f"{name}: Key '{key}' not in '{schema.__name__}'")
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            _refuse_undeclared(child, name)


def _load_plugins(cfg: DictConfig) -> DictConfig:
    """Import the config's `plugins` and MCORE_RL_PLUGINS' modules before anything is typed, so their names are
    valid choices (a list in a yaml is only seen here; one on the command line was imported by train.py already).
    The returned config lists both, so run.dir/config.yaml records every plugin the run used (mcore-rl-eval
    RUN_DIR loads them from there)."""
    from mcore_rl import plugins

    listed = [str(m) for m in OmegaConf.select(cfg, "plugins", default=None) or []]
    every = plugins.parse([*listed, *plugins.from_env()])
    try:
        plugins.load(every, export=False)  # the CLI exports the typed list to its child processes (train.py)
    except plugins.PluginError as e:
        raise ConfigError(str(e)) from None
    register_configs()  # a plugin algorithm's schema, for the configs composed after this one (multirun jobs)
    if every == listed:
        return cfg
    cfg = cfg.copy()
    cfg.plugins = every
    return cfg


def _typed_algorithm(cfg: DictConfig) -> DictConfig:
    """Type the algorithm node by its registered config class when its yaml named no schema (a plugin's yaml
    whose plugin is listed in a yaml: its schema was not in the ConfigStore when Hydra composed) or a base of it
    (`algorithm=grpo algorithm.name=my_pkg.algos:MyGRPO`)."""
    name = OmegaConf.select(cfg, "algorithm.name", default=None)
    if not isinstance(name, str) or not name:
        return cfg
    from mcore_rl.algorithms import config_class

    try:
        schema = config_class(name)
    except (KeyError, ValueError) as e:
        raise ConfigError(str(e).strip("'\"")) from None
    except AttributeError:  # a module:attr name that is not an Algorithm class
        raise ConfigError(f"algorithm.name={name!r}: not an Algorithm subclass (no config_cls)") from None
    current = OmegaConf.get_type(cfg.algorithm)
    if current is schema or not (current in (None, dict) or issubclass(schema, current)):
        return cfg
    data = OmegaConf.to_container(cfg.algorithm, resolve=False)
    cfg = cfg.copy()
    cfg.algorithm = _typed(lambda: OmegaConf.merge(OmegaConf.structured(schema), data), "algorithm")
    return cfg


def load_config(cfg: DictConfig) -> MainConfig:
    """The composed Hydra config as typed objects, converted once: every group's `__post_init__` check and the
    algorithm's ran, `algorithm.max_response_len: null` is the rollout's own cap (trainer.max_new_tokens).
    Everything after this reads attributes of the returned dataclasses, never the DictConfig."""
    known = {f.name for f in fields(MainConfig)}
    stray = sorted(set(cfg.keys()) - known - {"hydra"})
    if stray:
        raise ConfigError(f"unknown top-level key(s) {stray}; known: {sorted(known)}")
    cfg = _typed_algorithm(_load_plugins(cfg))
    rollout_schema(cfg)
    _refuse_undeclared(cfg, "")
    if OmegaConf.select(cfg, "algorithm.max_response_len", default=0) is None:  # the schema checks it on creation
        cfg = cfg.copy()
        cfg.algorithm.max_response_len = cfg.trainer.max_new_tokens
    main: MainConfig = _typed(lambda: OmegaConf.to_object(cfg), "")
    from mcore_rl.algorithms import build_algorithm

    try:
        build_algorithm(main.algorithm)  # the algorithm's cross-field checks (its schema ran its own)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(str(e).strip("'\"")) from None
    return main


def validate(cfg: DictConfig) -> None:
    """Every check load_config runs, as one-line ConfigErrors (for tools that only check a config)."""
    load_config(cfg)



__all__ = [
    "ConfigError", "EvalConfig", "Fp8Config", "LoadCheckConfig", "LocalRolloutConfig", "LoggingConfig", "MainConfig",
    "ModelConfig", "MoeConfig", "load_config", "OptimSettings", "ParallelConfig", "PartialRolloutConfig", "RunConfig", "SGLangLauncherSettings",
    "SGLangRolloutConfig", "TrainerConfig", "register_configs", "rollout_schema", "validate",
]
