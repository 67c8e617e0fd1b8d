"""Every Hydra yaml validates against its dataclass and builds; bad configs fail with a named key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from mcore_rl.algorithms import Algorithm, build_algorithm, config_class, registered_algorithms
from mcore_rl.algorithms.base import TokenBatch

pytestmark = pytest.mark.algorithms
YAML_DIR = Path(__file__).resolve().parents[2] / "hydra_conf" / "algorithm"
YAMLS = sorted(YAML_DIR.glob("*.yaml"))


def test_expected_yamls_exist():
    assert {p.stem for p in YAMLS} >= {"grpo", "dapo", "dr_grpo", "mu_grpo", "p3o", "ppo_ewma", "scalerl"}


def load_algorithm_yaml(path: Path) -> dict:
    """A yaml as Hydra composes it: its schema's defaults (named in `defaults`) overlaid with what it sets."""
    raw = OmegaConf.to_container(OmegaConf.load(path))
    raw.pop("defaults", None)
    return OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(config_class(raw["name"])), raw))


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.stem)
def test_yaml_validates_and_builds(path):
    cfg = OmegaConf.load(path)
    assert cfg.name in registered_algorithms()
    assert list(cfg.defaults) == [f"/schema/algorithm/{cfg.name}@_here_", "_self_"]
    alg = build_algorithm(load_algorithm_yaml(path))
    assert isinstance(alg, Algorithm) and alg.name == cfg.name
    # what the yaml sets is what the build holds (the rest are the dataclass defaults: tests/config)
    for key, value in OmegaConf.to_container(cfg).items():
        if key == "defaults":
            continue
        got = getattr(alg.config, key)
        assert (dataclasses.asdict(got) if dataclasses.is_dataclass(got) else got) == value, key


def test_presets_and_trainer_fields():
    mu = build_algorithm(load_algorithm_yaml(YAML_DIR / "mu_grpo.yaml")).config
    assert (mu.schedule, mu.updates_per_stage, mu.eps_low, mu.eps_high) == ("staged", 1024, 1.0, 4.0)
    grpo = build_algorithm(load_algorithm_yaml(YAML_DIR / "grpo.yaml"))
    assert (grpo.config.schedule, grpo.config.updates_per_rollout, grpo.config.old_logp_source) == ("sync", 4,
                                                                                                   "recompute")
    assert grpo.needs_old_logp and grpo.needs_ref_logp and not grpo.needs_prox_logp
    dapo = build_algorithm({"name": "dapo"}).config
    assert (dapo.eps_high, dapo.filter_zero_variance, dapo.dynamic_sampling) == (0.28, True, True)
    ewma = build_algorithm({"name": "ppo_ewma"})
    assert ewma.needs_prox_logp and not ewma.needs_old_logp
    scalerl = build_algorithm({"name": "scalerl"}).config
    assert (scalerl.eps_max, scalerl.loss_agg_mode, scalerl.adv_std_norm, scalerl.retire_pass_rate,
            scalerl.max_staleness) == (5.0, "prompt-mean", "batch", 0.9, 8)


def test_override_from_dictconfig_with_interpolation():
    cfg = OmegaConf.create({"L": 512, "algorithm": {"name": "dr_grpo", "max_response_len": "${L}"}})
    assert build_algorithm(cfg.algorithm).config.max_response_len == 512


@pytest.mark.parametrize("cfg,match", [
    ({"name": "nope"}, r"algorithm.name='nope': expected one of cispo, dapo"),
    ({"eps_low": 0.1}, r"no 'name'"),
    ({"name": "grpo", "eps_hihg": 0.3}, r"algorithm 'grpo': unknown config key 'eps_hihg'"),
    ({"name": "mu_grpo", "correction": {"mod": "tis"}}, r"algorithm 'mu_grpo': unknown config key 'correction.mod'"),
    ({"name": "p3o", "ess_scope": "global"}, r"ess_scope='global' is not one of"),
    ({"name": "grpo", "eps_high": "wide"}, r"algorithm 'grpo': bad value for 'eps_high'"),
    ({"name": "grpo", "loss_agg_mode": "mean"}, r"loss_agg_mode='mean'"),
    ({"name": "grpo", "correction": {"mode": "tis"}, "old_logp_source": "rollout"}, r"correction.ratio=old needs"),
    ({"name": "grpo", "loss_agg_mode": "seq-mean-token-sum-norm"}, r"max_response_len must be set"),
    ({"name": "mu_grpo", "nav_scope": "suffix"}, r"nav_scope='suffix'"),
    ({"name": "ppo_ewma", "ewma_beta": 1.0}, r"ewma_beta must be in \[0, 1\)"),
    ({"name": "cispo", "eps_max": -1.0}, r"eps_min < eps_max"),
])
def test_bad_configs_name_the_problem(cfg, match):
    with pytest.raises(ValueError, match=match):
        build_algorithm(cfg)


def test_token_batch_missing_or_misshaped_field():
    alg = build_algorithm({"name": "ppo_ewma"})
    z = torch.zeros(2, 3)
    batch = TokenBatch(logp=z, mask=z, advantages=z, rollout_logp=z, token_weight=z)
    with pytest.raises(ValueError, match=r"TokenBatch.prox_logp is None but algorithm 'ppo_ewma' needs it"):
        alg.loss(batch)
    batch.prox_logp = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"TokenBatch.prox_logp has shape \(2, 4\)"):
        alg.loss(batch)


@pytest.mark.parametrize("name", ["grpo", "mu_grpo", "scalerl"])
def test_hydra_compose_of_algorithm_group(name):
    from hydra import compose, initialize_config_dir

    import mcore_rl.config  # noqa: F401  (registers the schemas the algorithm yamls name)

    with initialize_config_dir(config_dir=str(YAML_DIR.parent), version_base=None):
        cfg = compose(overrides=[f"+algorithm={name}", "algorithm.kl_coef=0.5"])
    alg = build_algorithm(cfg.algorithm)
    assert alg.name == name and alg.config.kl_coef == 0.5 and alg.needs_ref_logp
