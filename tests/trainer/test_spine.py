"""The spine's small contracts: the config is typed once (no DictConfig past load_config), model.dtype is resolved
into the run's record without touching the config, the run state round-trips through a checkpoint's meta, and a
checkpoint is due exactly when a round crosses a multiple of trainer.save_every."""

from __future__ import annotations

import pytest

from mcore_rl.config import LocalRolloutConfig, MainConfig, SGLangRolloutConfig, TrainerConfig, load_config
from mcore_rl.trainer.build import config_record
from mcore_rl.trainer.checkpointer import Checkpointer
from mcore_rl.trainer.state import RunState
from mcore_rl.trainer.weights import sync_options
from tests.config.keyscan import compose


def test_load_config_gives_dataclasses_all_the_way_down():
    cfg = load_config(compose(["model=tiny", "rollout=sglang", "algorithm=mu_grpo", "rollout.bucket_mb=64"]))
    assert isinstance(cfg, MainConfig) and isinstance(cfg.rollout, SGLangRolloutConfig)
    assert type(cfg.algorithm).__name__ == "MuGrpoConfig" and cfg.algorithm.schedule == "staged"
    assert cfg.trainer.prompts_per_update == 16  # the main job's value is the dataclass default
    assert sync_options(cfg.rollout, "/m").bucket_mb == 64.0
    local = load_config(compose(["model=tiny"]))
    assert isinstance(local.rollout, LocalRolloutConfig)
    assert sync_options(local.rollout, "/m").bucket_mb == 512.0  # the transport's own default (unbucketed copy)


def test_resolved_dtype_goes_into_the_record_not_the_config():
    cfg = load_config(compose(["model=smollm2"]))
    assert cfg.model.dtype == "auto"
    record = config_record(cfg, "fp32")
    assert record.model.dtype == "fp32" and cfg.model.dtype == "auto"
    assert record.trainer is cfg.trainer  # everything else as configured


def test_run_state_round_trips_through_the_checkpoint_meta():
    state = RunState(update=7, round=3, version=6, next_eval=10, last_eval=7)
    back = RunState()
    back.restore(state.saved())
    assert (back.update, back.round, back.version, back.next_eval) == (7, 3, 6, 10)
    assert back.last_eval is None  # per process: a resumed run may evaluate its first update again


class _Counting(Checkpointer):
    def __init__(self, save_every: int) -> None:  # only what maybe_save uses
        self.settings, self.saved_at = TrainerConfig(save_every=save_every), []

    def save(self, state: RunState):
        self.saved_at.append(state.update)


@pytest.mark.parametrize(("save_every", "per_round", "want"), [
    (4, 3, [6, 9, 12]),  # updates 3, 6, ..., 15: 4, 8 and 12 are crossed inside the rounds ending at 6, 9, 12
    (5, 5, [5, 10, 15, 20, 25]),
    (0, 3, []),  # 0: only at the end (save_final)
])
def test_checkpoint_due_when_a_round_crosses_save_every(save_every, per_round, want):
    ck, state = _Counting(save_every), RunState()
    for _ in range(5):
        state.update += per_round
        ck.maybe_save(state, per_round, stopping=False)
    assert ck.saved_at == want
    ck.maybe_save(state, per_round, stopping=True)  # a stop request always saves
    assert ck.saved_at[-1] == state.update
