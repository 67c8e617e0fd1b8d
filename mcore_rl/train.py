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

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hydra_conf")


def run_training(cfg: DictConfig) -> dict:
    from mcore_rl.trainer.loop import train
    from mcore_rl.trainer.run import Run

    return train(Run(cfg))


@hydra.main(config_path=CONFIG_DIR, config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    from mcore_rl.agreement import FatalRunError
    from mcore_rl.rollout.protocol import EngineFailure
    from mcore_rl.trainer.setup import ConfigError

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
        from mcore_rl.distributed import destroy_distributed

        destroy_distributed()


def main() -> None:
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    _hydra_main()


if __name__ == "__main__":
    main()
