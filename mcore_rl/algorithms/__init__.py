"""Policy-optimisation algorithms: pure functions of per-token tensors, independent of Megatron.

Build one with `build_algorithm(cfg.algorithm)`; an algorithm's module is imported when its name is first built
(registry.py).
"""

from mcore_rl.algorithms.advantages import AdvantageResult, compute_advantages, overlong_penalty
from mcore_rl.algorithms.aggregation import AGG_MODES, aggregate, aggregation_weights
from mcore_rl.algorithms.base import (
    AccumulationResult,
    Algorithm,
    AlgorithmConfig,
    PolicyTerms,
    StepDecision,
    TokenBatch,
)
from mcore_rl.algorithms.correction import CorrectionConfig, correction_weights
from mcore_rl.algorithms.ewma import EwmaWeights
from mcore_rl.algorithms.p3o import compute_ess
from mcore_rl.algorithms.pass_rate import PassRateHistory
from mcore_rl.algorithms.reduce import Reducer, identity_reduce, make_dist_reducer
from mcore_rl.algorithms.registry import (
    ALGORITHMS,
    algorithm_class,
    build_algorithm,
    config_class,
    parse_config,
    register_algorithm,
    registered_algorithms,
)

__all__ = [
    "AGG_MODES", "ALGORITHMS", "AccumulationResult", "AdvantageResult", "Algorithm", "AlgorithmConfig", "CorrectionConfig",
    "EwmaWeights", "PassRateHistory", "PolicyTerms", "Reducer", "StepDecision", "TokenBatch", "aggregate",
    "aggregation_weights", "algorithm_class", "build_algorithm", "compute_advantages", "compute_ess",
    "config_class", "correction_weights", "identity_reduce", "make_dist_reducer", "overlong_penalty",
    "parse_config", "register_algorithm", "registered_algorithms",
]
