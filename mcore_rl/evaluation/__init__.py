"""Evaluation and scaling tools: pass@k, held-out evaluation of a model (`mcore-rl-eval`), ScaleRL curve fits
(`mcore-rl-scaling`). Named `evaluation` (not `eval`) so it never shadows the builtin in tracebacks or imports."""

from mcore_rl.evaluation.passk import pass_at_k, summarize_correct

__all__ = ["pass_at_k", "summarize_correct"]
