"""Every option of every config group composes (with the defaults and with model=tiny) against the typed schemas,
validates, and holds no key that no dataclass declares; bad keys and values fail with one line naming the key."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from mcore_rl.algorithms import config_class
from mcore_rl.config import ConfigError, validate
from mcore_rl.data.registry import DATASETS, SAMPLER_KEYS
from mcore_rl.rewards.registry import part_kind, reward_config_class
from mcore_rl.utils import config_from_dict
from tests.config.keyscan import CONF, compose, group_options, option_overrides
from tests.conftest import run_train_batch

SAMPLER_FIELDS = {"seed", "shuffle"}  # data/sampler.py build_sampler


def check_data_keys(data: dict, where: str) -> None:
    """What build_dataset checks, without loading the data: the kind's dataclass takes every non-sampler key."""
    opts = dict(data)
    kind = opts.pop("kind")
    assert kind in DATASETS, f"{where}: data.kind={kind!r}"
    for key in SAMPLER_KEYS:
        stray = set(opts.pop(key, None) or {}) - SAMPLER_FIELDS
        assert not stray, f"{where}: data.{key} keys {stray} are read by nothing"
    config_from_dict(DATASETS[kind].config, opts, where)


def check_reward_keys(reward: dict) -> None:
    names = reward["name"].split("+")
    assert set(reward) <= {"name", "weights", "max_crash_rate", *names}, reward.keys()
    for n in names:
        config_from_dict(reward_config_class(part_kind(n)), reward.get(n) or {}, f"reward.{n}")  # its dataclass


@pytest.mark.parametrize("base", [[], ["model=tiny"]], ids=["defaults", "tiny"])
@pytest.mark.parametrize("group,option", group_options(), ids=lambda x: str(x))
def test_every_group_option_composes_and_every_key_is_declared(group, option, base):
    cfg = compose([*base, *option_overrides(group, option)])
    validate(cfg)  # typed groups' __post_init__ + the algorithm's dataclass (unknown keys refused by both)
    plain = OmegaConf.to_container(cfg, resolve=False)
    check_data_keys(plain["data"], f"data={option}" if group == "data" else "data")
    check_reward_keys(plain["reward"])
    if plain["eval"]["data"] is not None:
        check_data_keys(plain["eval"]["data"], "eval.data")


def test_every_group_is_covered():
    groups = {g for g, _ in group_options()}
    assert groups >= {"algorithm", "data", "logging", "model", "parallel", "reward", "rollout", "schedule"}
    assert sum(1 for _ in group_options()) >= 25


@pytest.mark.parametrize("path", sorted((CONF / "algorithm").glob("*.yaml")), ids=lambda p: p.stem)
def test_algorithm_yamls_say_only_what_differs(path):
    raw = OmegaConf.to_container(OmegaConf.load(path))
    raw.pop("defaults")
    name = raw.pop("name")
    defaults = dataclasses.asdict(config_class(name)())
    same = [k for k, v in raw.items() if defaults[k] == v]
    assert not same, f"{path.name} repeats dataclass defaults: {same}"
    assert f"/schema/algorithm/{name}@_here_" in path.read_text()


def test_override_of_default_only_algorithm_key():
    """The yamls no longer spell out every key, so the schema must let the CLI set the others."""
    cfg = compose(["algorithm=dapo", "algorithm.max_staleness=2", "algorithm.correction.mode=tis"])
    assert cfg.algorithm.max_staleness == 2 and cfg.algorithm.correction.mode == "tis"
    assert cfg.algorithm.eps_high == 0.28  # DapoConfig's own default


@pytest.mark.parametrize("override,needle", [
    ("trainer.stpes=3", "Key 'stpes' not in 'TrainerConfig'"),
    ("rollout.devic=cpu", "Key 'devic' not in 'LocalRolloutConfig'"),
    ("algorithm.eps_hihg=0.3", "Key 'eps_hihg' not in 'GrpoConfig'"),
    ("optim.lr=fast", "optim.lr=fast"),
])
def test_composition_refuses_unknown_keys(override, needle):
    from hydra.errors import HydraException

    with pytest.raises(HydraException) as e:
        compose([override])
    text = str(e.value) + str(e.value.__cause__)
    assert needle in text, text


@pytest.mark.parametrize("overrides,message", [
    (["trainer.steps=-1"], "trainer.steps=-1 must be >= 0"),
    (["trainer.resume=sometimes"], "trainer.resume='sometimes': expected one of auto, never"),
    (["trainer.top_p=0"], "trainer.top_p=0.0 must be in (0, 1]"),
    (["optim.decay_style=step"], "optim.decay_style='step': expected one of constant, linear, cosine"),
    (["optim.min_lr=1", "optim.lr=0.1"], "optim.min_lr=1.0 must be <= optim.lr=0.1"),
    (["parallel.tp=0"], "parallel.tp=0 must be > 0"),
    (["model.dtype=int8"], "model.dtype='int8': expected one of auto, fp32, bf16, fp16"),
    (["model.load_check.enabled=maybe"], "model.load_check.enabled='maybe'"),
    (["rollout.sync_mode=nccl"], "rollout.sync_mode='nccl': expected one of tensor, disk"),
    (["rollout=sglang", "rollout.sync_mode=nccl"], "rollout.sync_mode=nccl needs rollout.nccl"),
    (["eval.samples_per_prompt=0"], "eval.samples_per_prompt=0 must be > 0"),
    (["+trainer.stpes=3"], "trainer.stpes"),          # `+` bypasses Hydra's struct check; validate() does not
    (["+rollout.devic=cpu"], "rollout.devic"),
    (["+surprise=1"], "unknown top-level key(s) ['surprise']"),
    (["algorithm.loss_agg_mode=mean"], "loss_agg_mode='mean'"),
])
def test_validation_is_one_line_naming_the_key(overrides, message):
    cfg = compose(["model=tiny", *overrides])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


MISSPELLED = [
    ("trainer.stpes=3", "config error: Could not override 'trainer.stpes'; Key 'stpes' not in 'TrainerConfig'"),
    ("+trainer.stpes=3", "config error: trainer.stpes: Key 'stpes' not in 'TrainerConfig'"),
    ("trainer.steps=many", "config error: Error merging override trainer.steps=many"),
]


@pytest.fixture(scope="module")
def misspelled_runs(tmp_path_factory) -> dict:
    """The three command lines through the CLI's main() in one interpreter (tests/train_batch.py)."""
    root = tmp_path_factory.mktemp("misspelled")
    runs = [["model=tiny", override, f"run.dir={root / str(i)}"] for i, (override, _) in enumerate(MISSPELLED)]
    return dict(zip((o for o, _ in MISSPELLED), run_train_batch(runs, root)))


@pytest.mark.e2e
@pytest.mark.parametrize("override,needle", MISSPELLED)
def test_cli_misspelled_key_one_line_exit_2(override, needle, misspelled_runs):
    proc = misspelled_runs[override]
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "config error" in ln]  # torch's CUDA wheel may log a warning after it
    assert len(errors) == 1 and needle in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
