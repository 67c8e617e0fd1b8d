"""`mcore-rl-train`: compose the Hydra config, build the run, train. Works as one process or under torchrun."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from mcore_rl.compat.malloc import tune_malloc

tune_malloc()  # before torch starts its threads: keeps resident memory flat across steps
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from mcore_rl import plugins  # noqa: E402
from mcore_rl.config import register_configs  # noqa: E402
from mcore_rl.config.paths import CONFIG_DIR  # noqa: E402  (re-exported: tests and benchmarks compose with it)

try:  # a child of a run re-importing this module (the workers' forkserver does) imports the run's plugins too
    plugins.load_env()
except plugins.PluginError:
    pass  # in the CLI's own process main() imports them again and reports the failure in one line
register_configs()  # the schemas hydra_conf/ names in its defaults lists (mcore_rl/config/), plugins' included
if os.environ.get("MCORE_RL_CONFIG_READS"):  # the keys-read test's recorder (mcore_rl/config_reads.py); off by default
    from mcore_rl.config_reads import install_from_env

    install_from_env()


def run_training(cfg: DictConfig) -> dict:
    """The composed config, typed once (one-line errors before anything heavy), built, trained."""
    from mcore_rl.config import load_config
    from mcore_rl.trainer.build import build
    from mcore_rl.trainer.loop import train

    main = load_config(cfg)
    plugins.export_env(main.plugins)  # every process the run starts (workers, their forkserver) imports them too
    check_names(main)
    components, state = build(main)
    return train(components, state)


def check_names(cfg) -> None:
    """The environment's and data kind's names checked against their registries (plugins imported by now), and a
    `module:attr` name's object against what the registry holds, before anything is built: a misspelled, unloaded
    or wrong name fails in one line, not after the model loaded."""
    from mcore_rl.config import ConfigError
    from mcore_rl.registry import RegistryError

    try:
        if cfg.env is not None:
            from mcore_rl.envs import ENVS, Environment

            name = str(cfg.env.get("name") or "")
            entry = ENVS.get(name)
            if not (isinstance(entry, type) and issubclass(entry, Environment)):
                raise ConfigError(f"env={name!r}: not an Environment subclass")
        elif cfg.data is not None:
            from mcore_rl.data.registry import DATASETS, DataKind

            kind = str(cfg.data.get("kind"))
            if not isinstance(DATASETS.get(kind), DataKind):
                raise ConfigError(f"data.kind={kind!r}: not a loader registered with @register_dataset")
    except RegistryError as e:
        raise ConfigError(str(e)) from None


@hydra.main(config_path=CONFIG_DIR, config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    run_or_exit(lambda: run_training(cfg))


def run_or_exit(run: Callable[[], Any]) -> None:
    """`run()` as an entry point runs it (mcore-rl-train, mcore-rl-sft): a known failure is one line and its exit
    code (config 2, fault 1, engine 3), never a traceback; the process group is torn down either way."""
    from mcore_rl.agreement import FatalRunError
    from mcore_rl.config import ConfigError
    from mcore_rl.rollout.protocol import EngineFailure

    logging.basicConfig(level=logging.WARNING, format="[%(asctime)s %(name)s] %(message)s")
    try:
        run()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    except FatalRunError as e:  # a fault the run cannot survive: one line, non-zero exit, no traceback
        print(f"run stopped: {e}", file=sys.stderr)
        sys.exit(1)
    except EngineFailure as e:
        print(f"rollout engine failed: {e}", file=sys.stderr)
        sys.exit(3)
    finally:
        import signal

        from mcore_rl.distributed import destroy_distributed

        # The run is over: a late preemption USR1 must not turn a clean exit into death by signal (Python puts
        # SIG_DFL back for handled signals while it shuts down).
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        destroy_distributed()


def composition_error(e: BaseException) -> str | None:
    """One line for a config Hydra could not compose (a misspelled key, a bad value type, an unknown group
    entry), naming the key, or for a plugin that failed to import; None for any other exception."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from mcore_rl.plugins import PluginError

    if isinstance(e, PluginError):
        return str(e)
    if not isinstance(e, (HydraException, OmegaConfBaseException)):
        return None
    parts: list[str] = []
    while e is not None and len(parts) < 2:  # Hydra's own line, then OmegaConf's (which names the schema)
        head = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        if head and "$" not in head and head.rstrip(".") not in parts:
            parts.append(head.rstrip("."))
        e = e.__cause__ or e.__context__
    return "; ".join(parts)


def plugins_in_overrides(args: list[str]) -> list[str]:
    """The modules a `plugins=[...]` override names (also `+plugins=`, and every value of a `-m` sweep over it).
    Read before Hydra composes: a plugin algorithm's yaml names its schema (`/schema/algorithm/<name>`), which
    must be in the ConfigStore by then."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep

    parser, out = OverridesParser.create(), []
    for arg in args:
        if arg.lstrip("+").split("=", 1)[0] != "plugins" or "=" not in arg:
            continue
        value = parser.parse_override(arg).value()
        values = value.list if isinstance(value, ChoiceSweep) else [value]
        for v in values:
            out += [v] if isinstance(v, str) else list(v or [])
    return out


def load_plugins(args: list[str]) -> None:
    """Import the plugins MCORE_RL_PLUGINS and the command line name, then store the schemas of the algorithms
    they registered (register_configs). The list is exported to MCORE_RL_PLUGINS for every child process."""
    plugins.load([*plugins.from_env(), *plugins_in_overrides(args)])
    register_configs()


def main() -> None:
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    # Hydra re-raises composition errors instead of printing them over several lines: we print one
    user_full_error = os.environ.get("HYDRA_FULL_ERROR")
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        load_plugins(sys.argv[1:])
        _hydra_main()
    except Exception as e:
        line = None if user_full_error else composition_error(e)
        if line is None:
            raise
        print(f"config error: {line}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
