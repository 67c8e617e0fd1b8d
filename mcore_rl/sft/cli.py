"""`mcore-rl-sft`: compose hydra_conf/sft.yaml, build the SFT run, train. One process or under torchrun.

Why an entry point of its own (docs/sft.md): an SFT run has no rollout engine, reward, algorithm or environment;
sharing `mcore-rl-train` would mean a mode switch that every RL component checks, and RL keys an SFT run would
accept and ignore. The groups both share (model, parallel, logging, optim) are the same yamls and dataclasses.
"""

from __future__ import annotations

import os
import sys

from mcore_rl.compat.malloc import tune_malloc

tune_malloc()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from mcore_rl.config import register_configs  # noqa: E402
from mcore_rl.config.paths import CONFIG_DIR  # noqa: E402
from mcore_rl.sft.config import register_sft_schema  # noqa: E402

register_configs()
register_sft_schema()


def run_sft(cfg: DictConfig) -> dict:
    """The composed config typed once (one-line errors before anything heavy), built, trained."""
    from mcore_rl.sft.config import load_sft_config
    from mcore_rl.sft.run import build_sft, train_sft

    return train_sft(build_sft(load_sft_config(cfg)))


@hydra.main(config_path=CONFIG_DIR, config_name="sft", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    from mcore_rl.train import run_or_exit

    run_or_exit(lambda: run_sft(cfg))


def main() -> None:
    import warnings

    from mcore_rl.train import composition_error

    for category in (UserWarning, DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category)
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
