"""Historical pass rates for ScaleRL's no-positive-resampling.

Prompts the policy already solves almost always (pass rate >= threshold, 0.9 in ScaleRL) give little signal and
waste generation, so they are retired permanently: the data sampler skips ids for which is_retired() is True.
A sample passes when its (correctness) reward >= success_threshold; feed raw correctness rewards, not shaped ones.
With several DP ranks, update the history with the gathered (global) ids and rewards so all ranks agree.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from torch import Tensor


class PassRateHistory:
    def __init__(self, threshold: float = 0.9, success_threshold: float = 0.5, min_attempts: int = 1) -> None:
        if not 0 < threshold <= 1:
            raise ValueError(f"pass-rate threshold must be in (0, 1], got {threshold}")
        if min_attempts < 1:
            raise ValueError(f"min_attempts must be >= 1, got {min_attempts}")
        self.threshold = float(threshold)
        self.success_threshold = float(success_threshold)
        self.min_attempts = int(min_attempts)
        self.passes: dict[Hashable, int] = {}
        self.attempts: dict[Hashable, int] = {}
        self.retired: dict[Hashable, None] = {}   # ordered set, survives weights_only checkpoints as a list

    def update(self, prompt_ids: Sequence[Hashable], rewards: Tensor | Iterable[float]) -> list[Hashable]:
        """Record one reward per sample (prompt_ids[i] is the prompt of sample i); returns newly retired ids."""
        values = rewards.detach().flatten().tolist() if isinstance(rewards, Tensor) else [float(r) for r in rewards]
        if len(values) != len(prompt_ids):
            raise ValueError(f"PassRateHistory.update: {len(prompt_ids)} prompt ids but {len(values)} rewards")
        touched = []
        for pid, r in zip(prompt_ids, values):
            pid = pid.item() if isinstance(pid, Tensor) else pid
            self.attempts[pid] = self.attempts.get(pid, 0) + 1
            self.passes[pid] = self.passes.get(pid, 0) + int(r >= self.success_threshold)
            touched.append(pid)
        newly = []
        for pid in dict.fromkeys(touched):
            if pid not in self.retired and self.attempts[pid] >= self.min_attempts \
                    and self.pass_rate(pid) >= self.threshold:
                self.retired[pid] = None
                newly.append(pid)
        return newly

    def pass_rate(self, prompt_id: Hashable) -> float | None:
        n = self.attempts.get(prompt_id, 0)
        return self.passes[prompt_id] / n if n else None

    def is_retired(self, prompt_id: Hashable) -> bool:
        return prompt_id in self.retired

    def metrics(self) -> dict[str, float]:
        seen = len(self.attempts)
        return {"retired_prompts": float(len(self.retired)), "seen_prompts": float(seen),
                "retired_frac": len(self.retired) / seen if seen else 0.0}

    def state_dict(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "success_threshold": self.success_threshold,
                "min_attempts": self.min_attempts, "passes": dict(self.passes), "attempts": dict(self.attempts),
                "retired": list(self.retired)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"threshold", "passes", "attempts", "retired"} - set(state)
        if missing:
            raise ValueError(f"PassRateHistory state_dict lacks {sorted(missing)}")
        self.threshold = float(state["threshold"])
        self.success_threshold = float(state.get("success_threshold", self.success_threshold))
        self.min_attempts = int(state.get("min_attempts", self.min_attempts))
        self.passes, self.attempts = dict(state["passes"]), dict(state["attempts"])
        self.retired = dict.fromkeys(state["retired"])


__all__ = ["PassRateHistory"]
