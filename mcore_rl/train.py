"""`mcore-rl-train`: compose the Hydra config, build the run, train. Works as one process or under torchrun."""

from __future__ import annotations

import logging
import os
import sys

from mcore_rl.compat.malloc import tune_malloc

tune_malloc()  # before torch starts its threads: keeps resident memory flat across steps
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from mcore_rl.config import register_configs  # noqa: E402
from mcore_rl.config.paths import CONFIG_DIR  # noqa: E402  (re-exported: tests and benchmarks compose with it)

register_configs()  # the schemas hydra_conf/ names in its defaults lists (mcore_rl/config/)
if os.environ.get("MCORE_RL_CONFIG_READS"):  # the keys-read test's recorder (mcore_rl/config_reads.py); off by default
    from mcore_rl.config_reads import install_from_env

    install_from_env()




def run_training(cfg: DictConfig) -> dict:
    """The composed config, typed once (one-line errors before anything heavy), built, trained."""
    from mcore_rl.config import load_config
    from mcore_rl.trainer.build import build
    from mcore_rl.trainer.loop import train

    components, state = build(load_config(cfg))
    return train(components, state)


@hydra.main(config_path=CONFIG_DIR, config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    from mcore_rl.agreement import FatalRunError
    from mcore_rl.config import ConfigError
    from mcore_rl.rollout.protocol import EngineFailure

    logging.basicConfig(level=logging.WARNING, format="[%(asctime)s %(name)s] %(message)s")
    try:
        run_training(cfg)
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
    entry), naming the key; None for any other exception."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(e, (HydraException, OmegaConfBaseException)):
        return None
    parts: list[str] = []
    while e is not None and len(parts) < 2:  # Hydra's own line, then OmegaConf's (which names the schema)
        head = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        if head and "$" not in head and head.rstrip(".") not in parts:
            parts.append(head.rstrip("."))
        e = e.__cause__ or e.__context__
    return "; ".join(parts)


def main() -> None:
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    # Hydra re-raises composition errors instead of printing them over several lines: we print one
    user_full_error = os.environ.get("HYDRA_FULL_ERROR")
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        _hydra_main()
    except Exception as e:
        line = None if user_full_error else composition_error(e)
        if line is None:
            raise
        print(f"config error: {line}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
