"""Every key a config dataclass declares is read by code outside validation (AST scan of mcore_rl/), and every
key of every composed group option is set through the CLI by some test (or listed below with the reason)."""

from __future__ import annotations

import pytest

from mcore_rl.algorithms import config_class, registered_algorithms
from mcore_rl.config import ROLLOUT_SCHEMAS, MainConfig
from mcore_rl.data.registry import DATASETS
from mcore_rl.rewards.format_reward import FormatConfig
from mcore_rl.rewards.verifier import MathVerifyConfig
from tests.config.keyscan import (
    REPO,
    cli_overrides_in_tests,
    code_names,
    compose,
    dataclass_fields,
    group_options,
    leaf_keys,
    option_overrides,
)

SCHEMAS = [MainConfig, *ROLLOUT_SCHEMAS.values(), *(config_class(n) for n in registered_algorithms()),
           *(k.config for k in DATASETS.values()), MathVerifyConfig, FormatConfig]

# Declared but read only by validation today, each with its owner. Empty this as they are wired.
NOT_YET_READ = {
    "launcher.server": "read in LauncherConfig.__post_init__, where it picks the server command (not a check)",
}


@pytest.fixture(scope="module")
def names() -> set[str]:
    return code_names(REPO / "mcore_rl", exclude=(REPO / "mcore_rl" / "config",))


def test_scan_is_not_vacuous(names):
    assert {"steps", "sync_dir", "memory_limit_mb", "wandb_project", "keep_versions"} <= names
    assert "definitely_not_a_config_key" not in names


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda c: c.__name__)
def test_every_declared_key_is_read(schema, names):
    unread = sorted(k for k, n in dataclass_fields(schema) if n not in names and k not in NOT_YET_READ
                    and n not in NOT_YET_READ)
    assert not unread, f"{schema.__name__}: declared, read by no code outside validation: {unread}"


# Keys no test sets through the CLI, by reason. A new key must be set in a CLI test (test_cli_keys.py) or be
# listed here with why it cannot run on a CPU CI machine.
CLI_EXEMPT = {
    "model.fp8": "Transformer Engine + CUDA only (tests/gpu)",
    "model.transformer_impl": "auto|local on CPU; transformer_engine needs CUDA (tests/gpu)",
    "model.mcore_ckpt": "set by tests/convert through mcore-rl-convert, then model.mcore_ckpt in tests/gpu",
    "model.recompute_activations": "needs TE's checkpointing on GPU to differ (tests/gpu)",
    "logging.wandb": "needs the optional wandb package and an account",
    "logging.wandb_project": "needs the optional wandb package and an account",
    "rollout.nccl": "NCCL weight sync: GPU only",
    "rollout.launcher.gpu_ids": "CUDA_VISIBLE_DEVICES slices: GPU only",
    "parallel.sequence_parallel": "set in tests/multiproc through the worker, not the CLI",
}


def _covered(key: str, tested: set[str]) -> bool:
    parts = key.split(".")
    return any(".".join(parts[:i]) in tested for i in range(1, len(parts) + 1)) or any(
        t.startswith(key + ".") for t in tested)  # a dict-valued key (model.tiny) set entry by entry


def test_every_composed_key_is_set_through_the_cli_in_a_test():
    keys: set[str] = set()
    for group, option in group_options():
        keys |= set(leaf_keys(compose(["model=tiny", *option_overrides(group, option)])))
    tested = cli_overrides_in_tests(REPO / "tests")
    untested = sorted(k for k in keys if not _covered(k, tested) and not _covered(k, set(CLI_EXEMPT)))
    algo = [k for k in untested if k.startswith("algorithm.")]
    rest = [k for k in untested if not k.startswith("algorithm.")]
    assert not rest, f"{len(rest)} keys no test sets through the CLI: {rest}"
    assert not algo, f"{len(algo)} algorithm keys no test sets through the CLI: {algo}"
