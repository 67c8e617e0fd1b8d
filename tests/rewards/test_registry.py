"""build_reward from the Hydra `reward` group: single, combined, and clear errors."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from mcore_rl.rewards import CombinedReward, CrashRateGuard, MathVerifyReward, build_reward

pytestmark = pytest.mark.rollout

CONF = Path(__file__).resolve().parents[2] / "hydra_conf"


def _reward_cfg(name: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name=None, overrides=[f"+reward={name}"]).reward


def test_default_math_yaml_builds_math_verify():
    cfg = _reward_cfg("math")
    assert cfg.name == "math_verify"
    fn = build_reward(cfg)
    try:
        assert isinstance(fn, CrashRateGuard) and fn.max_crash_rate == cfg.max_crash_rate
        assert isinstance(fn.inner, MathVerifyReward) and fn.inner.cfg.timeout_s == cfg.math_verify.timeout_s
        assert fn.inner.pool.options.memory_limit_mb == cfg.math_verify.memory_limit_mb
        res = fn.score(["3 + 4 = 7", "3 + 4 = 8", "\\boxed{\\frac{2}{4}}"], ["7", "7", "\\frac{1}{2}"])
        assert [r.score for r in res] == [1.0, 0.0, 1.0]
    finally:
        fn.close()


def test_math_format_combines_with_weights():
    cfg = _reward_cfg("math_format")
    assert cfg.name == "math_verify+format" and cfg.math_verify.num_workers == 2  # inherited from math.yaml
    fn = build_reward(cfg)
    try:
        assert isinstance(fn, CrashRateGuard) and isinstance(fn.inner, CombinedReward)
        res = fn.score(["so \\boxed{7}", "7 is it, I think", "\\boxed{8}", "no idea"], ["7"] * 4)
        assert [r.score for r in res] == pytest.approx([1.1, 1.0, 0.1, 0.0])
        assert [r.correct for r in res] == [True, True, False, False]
        assert res[2].reason == "math_verify=wrong_answer,format=format_ok"
        assert res[0].extracted == "7"
    finally:
        fn.close()


def test_format_alone_needs_no_workers():
    fn = build_reward({"name": "format", "format": {"check": "boxed"}})
    assert [r.score for r in fn.score(["\\boxed{1}", "1"], ["1", "1"])] == [1.0, 0.0]


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"name": "math_verfy"}, "reward.name='math_verfy': expected one of format, function, judge, math_verify, remote, rm"),
        ({}, "reward.name must be a non-empty string"),
        ({"name": "format", "format": {"chek": "boxed"}}, r"reward.format: unknown option\(s\) \['chek'\]"),
        ({"name": "format", "formt": {}}, r"unexpected key\(s\) \['formt'\]"),
        ({"name": "format", "weights": {"math_verify": 1.0}}, r"unexpected key\(s\) \['math_verify'\]"),
        ({"name": "math_verify", "math_verify": {"timeout_s": 0}}, "timeout_s must be > 0"),
        ({"name": "math_verify", "math_verify": {"mp_context": "fork"}}, "fork is unsafe"),
        ({"name": "format", "max_crash_rate": 0}, r"reward.max_crash_rate must be in \(0, 1\]; got 0.0"),
    ],
)
def test_bad_config_errors_name_the_field(cfg, match):
    with pytest.raises(ValueError, match=match):
        build_reward(cfg)
