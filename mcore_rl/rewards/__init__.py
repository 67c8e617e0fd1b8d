"""Rewards: math-verify in a killable process pool, a format reward, and a registry for Hydra."""

from mcore_rl.rewards.base import CrashRateGuard, RewardFn, RewardResult, failure_counts, reward_metrics
from mcore_rl.rewards.extract import Extraction, extract_answer
from mcore_rl.rewards.format_reward import FormatConfig, FormatReward
from mcore_rl.rewards.pool import VerifierPool
from mcore_rl.rewards.registry import REWARDS, CombinedReward, build_reward, register_reward
from mcore_rl.rewards.verifier import MathVerifyConfig, MathVerifyReward

__all__ = [
    "REWARDS",
    "CombinedReward",
    "CrashRateGuard",
    "Extraction",
    "FormatConfig",
    "FormatReward",
    "MathVerifyConfig",
    "MathVerifyReward",
    "RewardFn",
    "RewardResult",
    "VerifierPool",
    "build_reward",
    "extract_answer",
    "failure_counts",
    "register_reward",
    "reward_metrics",
]
