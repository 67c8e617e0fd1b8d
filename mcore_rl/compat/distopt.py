"""Megatron-Core 0.16.1's distributed optimizer resuming from a `fully_reshardable` checkpoint with torch's Adam.

Without Apex / Transformer Engine, Megatron falls back to `torch.optim.Adam(W)`, which keeps the iteration count
as a per-parameter state tensor `step` (FusedAdam keeps it in the param group). `DistributedOptimizer.
load_state_dict` already restores that `step` into every parameter's state from the param groups; then
`load_parameter_state_from_fully_reshardable` passes the checkpoint's main param / exp_avg / exp_avg_sq (it skips
`step` on purpose) to `_set_main_param_and_optimizer_states`, which copies *every* key of the live state, `step`
included, and fails with `KeyError: 'step'`. The neutralisation copies the keys the checkpoint supplied and leaves
the already-restored `step` alone; each skipped key is recorded in `HITS`. With FusedAdam (TE/Apex on GPU) the live
state has no `step` and the wrapper never fires.

Before that, a resume asks a fresh optimizer for its state (`sharded_state_dict(is_loading=True)` round-trips
`state_dict()`), and the fallback's `state_dict` asserts that every parameter has exactly one `step`: a fresh torch
Adam has none yet (it creates its state lazily at the first step), so every resume failed with a bare
`AssertionError`. The neutralisation creates that state first, exactly as torch's Adam would at its first step
(`step` 0, zero moments), which the checkpoint then overwrites.

The same fallback restores that `step` as ONE tensor object put into every parameter's state; torch's Adam
increments each parameter's `step` in place, so after a resume the shared counter advanced once per parameter per
update and the bias correction of every later step was wrong (a resumed step 2 differed from the uninterrupted one
by 1.4 in log-prob on the tiny MoE). After `load_state_dict` every parameter gets its own copy (`HITS` counts the
parameters that shared one).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

HITS: Counter[str] = Counter()
_APPLIED = False


def _init_adam_state(opt: torch.optim.Optimizer) -> None:
    """torch.optim.Adam(W)'s own first-step initialisation, done ahead of the first step."""
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            st["step"] = torch.tensor(0.0, dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


_UPSTREAM: dict[str, Any] = {}


def _set_supplied_states(self, model_param, tensors) -> None:
    """Copy what the checkpoint supplied; keep the `step` that load_state_dict already restored."""
    upstream = _UPSTREAM["_set_main_param_and_optimizer_states"]
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


def _load_with_own_steps(self, state_dict) -> None:
    _UPSTREAM["load_state_dict"](self, state_dict)
    seen: set[int] = set()
    for st in self.optimizer.state.values():
        step = st.get("step")
        if torch.is_tensor(step):
            if id(step) in seen:
                HITS["distrib_optimizer.load_state_dict: shared step tensor copied"] += 1
                st["step"] = step.clone()
            seen.add(id(step))


def _state_dict_of_fresh_adam(self) -> dict:
    from megatron.core.optimizer import distrib_optimizer

    if not distrib_optimizer.HAVE_APEX_OR_TE and len(self.optimizer.state) == 0:
        HITS["distrib_optimizer.state_dict: fresh torch Adam state created"] += 1
        _init_adam_state(self.optimizer)
    return _UPSTREAM["state_dict"](self)


def apply() -> bool:
    """Idempotent; returns True once the wrappers are installed."""
    global _APPLIED
    if _APPLIED:
        return True
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    wrappers = {"_set_main_param_and_optimizer_states": _set_supplied_states,
                "load_state_dict": _load_with_own_steps, "state_dict": _state_dict_of_fresh_adam}  # fmt: skip
    for name, wrapper in wrappers.items():
        _UPSTREAM[name] = getattr(DistributedOptimizer, name)
        setattr(DistributedOptimizer, name, wrapper)
    _APPLIED = True
    return True
