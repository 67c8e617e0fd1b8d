"""Reward registry: `build_reward(cfg)` turns the Hydra `reward` group into a RewardFn.

`cfg.name` is one part or several joined by "+" (e.g. "math_verify+format"); each part reads its options from
the section of the same name and is weighted by `cfg.weights[part]` (default 1.0). A part is a registered reward
name, optionally followed by a number, so one kind can appear more than once with its own settings:
"function+function2" runs two reward functions, each configured in its own section (`function`, `function2`).
`check_reward(cfg)` validates all of it without starting anything heavy (it does import a reward function's
module), so a bad reward fails before any model is built.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

from mcore_rl.registry import Registry
from mcore_rl.rewards.base import (
    CrashRateGuard,
    RewardFn,
    RewardResult,
    check_crash_rate,
    check_lengths,
    describe,
    score_with_records,
    uses_text,
)
from mcore_rl.utils import config_from_dict

RewardBuilder = Callable[[dict[str, Any]], RewardFn]
REWARDS: Registry[RewardBuilder] = Registry(
    "reward.name",
    {"math_verify": "mcore_rl.rewards.verifier", "format": "mcore_rl.rewards.format_reward",
     "function": "mcore_rl.rewards.function", "remote": "mcore_rl.rewards.remote",
     "rm": "mcore_rl.rewards.reward_model", "judge": "mcore_rl.rewards.judge"},
)
# name -> the dataclass its options are built into (config audits, check_reward); name -> a cheap extra check
_CONFIGS: dict[str, type] = {}
_CHECKS: dict[str, Callable[[Any], None]] = {}


def register_reward(name: str, config: type | None = None,
                    check: Callable[[Any], None] | None = None) -> Callable[[RewardBuilder], RewardBuilder]:
    """Decorator for `builder(options) -> RewardFn`; `options` is the reward's own section of the config. `config`:
    the dataclass those options are built into; `check(config_obj, where)`: a cheap test run before any model is
    built (e.g. that a function's module imports), raising ValueError with one line that names `where`."""
    if config is not None:
        _CONFIGS[name] = config
    if check is not None:
        _CHECKS[name] = check
    return REWARDS.register(name)


def reward_config_class(name: str) -> type | None:
    """The options dataclass of a registered reward (imports its module), None when it registered none."""
    REWARDS.get(name)
    return _CONFIGS.get(name)


def part_kind(part: str) -> str:
    """The registered name behind a part name: "function2" -> "function" (a name registered as is wins)."""
    if part in REWARDS:
        return part
    base = re.sub(r"\d+$", "", part)
    return base if base and base != part and base in REWARDS else REWARDS.check(part)


class CombinedReward:
    """Weighted sum of parts. `correct` comes from the parts that judge correctness (any of them). Extra metrics of
    the parts are merged; a key an earlier part already reported is kept as `<part>/<key>`. Each part's own
    (unweighted) score is a metric named after the part, logged as `reward/<part>`: what each part contributes."""

    def __init__(self, parts: list[tuple[str, RewardFn, float]]):
        self.parts = parts
        self.uses_text = any(uses_text(fn) for _, fn, _ in parts)

    def score(self, responses: list[str], answers: list[str], records: list[dict] | None = None
              ) -> list[RewardResult]:
        check_lengths(responses, answers, records)
        per_part = [(name, score_with_records(fn, responses, answers, records), w) for name, fn, w in self.parts]
        out = []
        for i in range(len(responses)):
            rs = [(name, res[i], w) for name, res, w in per_part]
            metrics: dict[str, float] = {name: r.score for name, r, _ in rs}
            for name, r, _ in rs:
                for k, v in r.metrics.items():
                    metrics[f"{name}/{k}" if k in metrics else k] = v
            out.append(RewardResult(
                score=sum(w * r.score for _, r, w in rs),
                correct=any(r.correct for _, r, _ in rs),
                reason=",".join(f"{name}={r.reason}" for name, r, _ in rs),
                extracted=next((r.extracted for _, r, _ in rs if r.extracted is not None), None),
                latency_s=max(r.latency_s for _, r, _ in rs),
                metrics=metrics,
            ))
        return out

    def describe(self) -> str:
        return " + ".join(f"{w:g} * {name}: {describe(fn)}" for name, fn, w in self.parts)

    def metrics(self) -> dict[str, float]:
        """The parts' counters; two parts of one kind (judge+judge2) report the same keys: their counts add up."""
        out: dict[str, float] = {}
        for _, fn, _ in self.parts:
            for k, v in (fn.metrics() if hasattr(fn, "metrics") else {}).items():
                out[k] = out.get(k, 0.0) + v
        return out

    def close(self) -> None:
        for _, fn, _ in self.parts:
            fn.close()


def _plain(cfg: Any) -> dict[str, Any]:
    if cfg is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    return dict(cfg)


def _parts(cfg: dict[str, Any]) -> tuple[list[str], dict[str, float]]:
    """The part names and weights of `cfg`, with every key checked (one line on the first bad one)."""
    name = cfg.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"reward.name must be a non-empty string like 'math_verify'; got {name!r}")
    names = [n.strip() for n in name.split("+")]
    for n in names:
        part_kind(n)
    if len(set(names)) < len(names):
        raise ValueError(f"reward.name={name!r} names a part twice; number repeats (function+function2)")
    weights = dict(cfg.get("weights") or {})
    stray = sorted(set(cfg) - {"name", "weights", "max_crash_rate"} - set(REWARDS) - set(names))
    stray += sorted(set(weights) - set(names))
    if stray:
        raise ValueError(f"reward: unexpected key(s) {stray} for reward.name={name!r}")
    return names, {n: float(weights.get(n, 1.0)) for n in names}


def _options(cfg: dict[str, Any], part: str) -> dict[str, Any]:
    """A part's section; a string stands for the reward's one required setting (`reward.function=mod:fn` is
    `reward.function.path=mod:fn`)."""
    section = cfg.get(part)
    if isinstance(section, str):
        return {"path": section}
    return dict(section or {})


def part_options(cfg: Mapping[str, Any] | Any) -> dict[str, tuple[str, dict[str, Any]]]:
    """Each part of the reward group: part name -> (registered kind, its options section as a plain dict). For code
    that builds what a part needs before the reward itself (the trainer's Megatron RM for `rm` parts)."""
    plain = _plain(cfg)
    if not plain:
        return {}
    return {n: (part_kind(n), _options(plain, n)) for n in _parts(plain)[0]}


def check_reward(cfg: Mapping[str, Any] | Any) -> None:
    """Validate the reward group without building it: names, weights, each part's options against its dataclass,
    and each part's own cheap check (a reward function's module imports). Raises ConfigError (one line, exit 2)."""
    # imported here, not at the top: mcore_rl.config stores every schema (all algorithms) on import, which reward
    # worker processes, importing this module, do not need
    from mcore_rl.config.checks import ConfigError

    cfg = _plain(cfg)
    try:
        names, _ = _parts(cfg)
        for n in names:
            kind = part_kind(n)
            config_cls = reward_config_class(kind)
            if config_cls is None:
                continue
            options = config_from_dict(config_cls, _options(cfg, n), f"reward.{n}")
            if kind in _CHECKS:
                _CHECKS[kind](options, where=f"reward.{n}")
        if cfg.get("max_crash_rate") is not None:
            check_crash_rate(cfg["max_crash_rate"])
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_reward(cfg: Mapping[str, Any] | Any, scorers: Mapping[str, Any] | None = None) -> RewardFn:
    """From `{name: "math_verify+format", weights: {...}, max_crash_rate: 0.5, math_verify: {...}, ...}`.
    With `max_crash_rate` set, the reward stops the run when that share of a step's cases crash. `scorers`: part
    name -> TokenScorer (rewards/reward_model.py) for `rm` parts scored by the caller (placement=trainer: the
    trainer's Megatron RM); a builder that takes a `scorer` gets its part's (None when not given)."""
    cfg = _plain(cfg)
    max_crash_rate = cfg.pop("max_crash_rate", None)
    fn = _build(cfg, dict(scorers or {}))
    return fn if max_crash_rate is None else CrashRateGuard(fn, float(max_crash_rate))


def _make(cfg: dict[str, Any], part: str, scorers: dict[str, Any]) -> RewardFn:
    builder = REWARDS[part_kind(part)]
    if "scorer" not in inspect.signature(builder).parameters:
        return builder(_options(cfg, part))
    return builder(_options(cfg, part), scorer=scorers.get(part), where=f"reward.{part}")


def _build(cfg: dict[str, Any], scorers: dict[str, Any]) -> RewardFn:
    names, weights = _parts(cfg)
    if stray := sorted(set(scorers) - set(names)):
        raise ValueError(f"build_reward: scorers given for {stray}, which reward.name={cfg['name']!r} does not name")
    if len(names) == 1 and weights[names[0]] == 1.0:
        return _make(cfg, names[0], scorers)
    parts: list[tuple[str, RewardFn, float]] = []
    try:
        for n in names:
            parts.append((n, _make(cfg, n, scorers), weights[n]))
    except Exception:
        for _, fn, _ in parts:
            fn.close()
        raise
    return CombinedReward(parts)

