"""Rewards: math-verify in a killable process pool, a format reward, reward functions from user code (in the same
sandboxed pool), remote reward services (OpenRLHF's protocol), reward models (`rm`: the trainer's Megatron RM or
SGLang's /classify) and LLM judges (`judge`: OpenAI-compatible /v1/chat/completions), and a registry for Hydra.
docs/rewards.md."""

from mcore_rl.rewards.base import (
    CrashRateGuard,
    RewardFn,
    RewardResult,
    describe,
    failure_counts,
    record_dict,
    reward_metrics,
    score_with_records,
    step_metrics,
    uses_text,
)
from mcore_rl.rewards.extract import Extraction, extract_answer
from mcore_rl.rewards.format_reward import FormatConfig, FormatReward
from mcore_rl.rewards.pool import VerifierPool
from mcore_rl.rewards.registry import REWARDS, CombinedReward, build_reward, check_reward, register_reward
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
    "check_reward",
    "describe",
    "extract_answer",
    "failure_counts",
    "record_dict",
    "register_reward",
    "reward_metrics",
    "score_with_records",
    "step_metrics",
    "uses_text",
]
