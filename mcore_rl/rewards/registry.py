"""Reward registry: `build_reward(cfg)` turns the Hydra `reward` group into a RewardFn.

`cfg.name` is one registered name or several joined by "+" (e.g. "math_verify+format"); each part reads its
options from the section of the same name and is weighted by `cfg.weights[part]` (default 1.0).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mcore_rl.registry import Registry
from mcore_rl.rewards.base import CrashRateGuard, RewardFn, RewardResult, check_lengths

RewardBuilder = Callable[[dict[str, Any]], RewardFn]
REWARDS: Registry[RewardBuilder] = Registry(
    "reward.name", {"math_verify": "mcore_rl.rewards.verifier", "format": "mcore_rl.rewards.format_reward"}
)


def register_reward(name: str) -> Callable[[RewardBuilder], RewardBuilder]:
    """Decorator for `builder(options) -> RewardFn`; `options` is the reward's own section of the config."""
    return REWARDS.register(name)


class CombinedReward:
    """Weighted sum of parts. `correct` comes from the parts that judge correctness (any of them)."""

    def __init__(self, parts: list[tuple[str, RewardFn, float]]):
        self.parts = parts

    def score(self, responses: list[str], answers: list[str]) -> list[RewardResult]:
        check_lengths(responses, answers)
        per_part = [(name, fn.score(responses, answers), w) for name, fn, w in self.parts]
        out = []
        for i in range(len(responses)):
            rs = [(name, res[i], w) for name, res, w in per_part]
            out.append(RewardResult(
                score=sum(w * r.score for _, r, w in rs),
                correct=any(r.correct for _, r, _ in rs),
                reason=",".join(f"{name}={r.reason}" for name, r, _ in rs),
                extracted=next((r.extracted for _, r, _ in rs if r.extracted is not None), None),
                latency_s=max(r.latency_s for _, r, _ in rs),
            ))
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


def build_reward(cfg: Mapping[str, Any] | Any) -> RewardFn:
    """From `{name: "math_verify+format", weights: {...}, max_crash_rate: 0.5, math_verify: {...}, ...}`.
    With `max_crash_rate` set, the reward stops the run when that share of a step's cases crash."""
    cfg = _plain(cfg)
    max_crash_rate = cfg.pop("max_crash_rate", None)
    fn = _build(cfg)
    return fn if max_crash_rate is None else CrashRateGuard(fn, float(max_crash_rate))


def _build(cfg: dict[str, Any]) -> RewardFn:
    name = cfg.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"reward.name must be a non-empty string like 'math_verify'; got {name!r}")
    names = [n.strip() for n in name.split("+")]
    for n in names:
        REWARDS.check(n)
    weights = dict(cfg.get("weights") or {})
    stray = sorted(set(cfg) - {"name", "weights"} - set(REWARDS)) + sorted(set(weights) - set(names))
    if stray:
        raise ValueError(f"reward: unexpected key(s) {stray} for reward.name={name!r}")
    if len(names) == 1 and weights.get(names[0], 1.0) == 1.0:
        return REWARDS[names[0]](dict(cfg.get(names[0]) or {}))
    parts: list[tuple[str, RewardFn, float]] = []
    try:
        for n in names:
            parts.append((n, REWARDS[n](dict(cfg.get(n) or {})), float(weights.get(n, 1.0))))
    except Exception:
        for _, fn, _ in parts:
            fn.close()
        raise
    return CombinedReward(parts)
