"""The config the CLI composes: the `schedule` group, `max_response_len` defaulting to trainer.max_new_tokens, and
the async guard (max_staleness >= 1)."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from mcore_rl.algorithms import build_algorithm
from mcore_rl.config import ConfigError, load_config
from mcore_rl.train import CONFIG_DIR
from mcore_rl.trainer.schedule import SCHEDULES


def _cfg(*overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="config", overrides=["model=tiny", "run.dir=/nonexistent/run", *overrides])


@pytest.mark.parametrize("name", ["sync", "staged", "async"])
def test_schedule_group_selects_a_registered_schedule(name):
    cfg = _cfg(f"schedule={name}")
    alg = build_algorithm(load_config(cfg).algorithm)
    assert alg.config.schedule == name and name in SCHEDULES
    if name == "async":
        assert (alg.config.max_staleness, alg.config.stale_policy) == (2, "drop")


def test_max_response_len_defaults_to_max_new_tokens():
    # dr_grpo's seq-mean-token-sum-norm needs L_max: null now means the rollout's own cap
    cfg = _cfg("algorithm=dr_grpo", "algorithm.max_response_len=null", "trainer.max_new_tokens=37")
    assert build_algorithm(load_config(cfg).algorithm).config.max_response_len == 37
    assert build_algorithm(load_config(_cfg("algorithm=dr_grpo")).algorithm).config.max_response_len == 4096


def test_async_without_staleness_is_a_config_error():
    with pytest.raises(ConfigError, match="schedule=async needs max_staleness >= 1"):
        load_config(_cfg("schedule=async", "algorithm.max_staleness=0"))
    with pytest.raises(ConfigError, match="stale_policy"):
        load_config(_cfg("schedule=async", "algorithm.stale_policy=keep"))
