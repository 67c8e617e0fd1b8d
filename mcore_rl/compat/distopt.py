"""Megatron-Core 0.16.1's distributed optimizer resuming from a `fully_reshardable` checkpoint with torch's Adam.

Without Apex / Transformer Engine, Megatron falls back to `torch.optim.Adam(W)`, which keeps the iteration count
as a per-parameter state tensor `step` (FusedAdam keeps it in the param group). `DistributedOptimizer.
load_state_dict` already restores that `step` into every parameter's state from the param groups; then
`load_parameter_state_from_fully_reshardable` passes the checkpoint's main param / exp_avg / exp_avg_sq (it skips
`step` on purpose) to `_set_main_param_and_optimizer_states`, which copies *every* key of the live state, `step`
included, and fails with `KeyError: 'step'`. The neutralisation copies the keys the checkpoint supplied and leaves
the already-restored `step` alone; each skipped key is recorded in `HITS`. With FusedAdam (TE/Apex on GPU) the live
state has no `step` and the wrapper never fires.

The same fallback restores that `step` as ONE tensor object put into every parameter's state; torch's Adam
increments each parameter's `step` in place, so after a resume the shared counter advanced once per parameter per
update and the bias correction of every later step was wrong (a resumed step 2 differed from the uninterrupted one
by 1.4 in log-prob on the tiny MoE). After `load_state_dict` every parameter gets its own copy (`HITS` counts the
parameters that shared one).
"""

from __future__ import annotations

from collections import Counter

import torch

HITS: Counter[str] = Counter()
_APPLIED = False


def apply() -> bool:
    """Idempotent; returns True once the wrapper is installed."""
    global _APPLIED
    if _APPLIED:
        return True
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    upstream = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_supplied_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return upstream(self, model_param, tensors)  # that branch copies only the supplied keys
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        live = self.optimizer.state[main_param]
        if {k for k in live if k not in tensors} != {"step"}:  # nothing to keep, or a real gap: upstream decides
            return upstream(self, model_param, tensors)
        HITS["distrib_optimizer._set_main_param_and_optimizer_states: step kept"] += 1
        main_param.detach().copy_(tensors["param"])
        for key, value in tensors.items():
            if key != "param":
                live[key].copy_(value)

    load_upstream = DistributedOptimizer.load_state_dict

    def load_with_own_steps(self, state_dict):
        load_upstream(self, state_dict)
        seen: set[int] = set()
        for st in self.optimizer.state.values():
            step = st.get("step")
            if torch.is_tensor(step):
                if id(step) in seen:
                    HITS["distrib_optimizer.load_state_dict: shared step tensor copied"] += 1
                    st["step"] = step.clone()
                seen.add(id(step))

    DistributedOptimizer._set_main_param_and_optimizer_states = set_supplied_states
    DistributedOptimizer.load_state_dict = load_with_own_steps
    _APPLIED = True
    return True
