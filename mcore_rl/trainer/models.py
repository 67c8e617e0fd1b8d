"""The run's networks and engine: the trainable policy (+ frozen reference, + PPO-EWMA's averaged weights) with
their initial weights checked against transformers, and rank 0's rollout engine in the policy's dtype."""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path
from typing import Any

from mcore_rl.algorithms import Algorithm
from mcore_rl.config import MainConfig
from mcore_rl.policy.policy import Policy
from mcore_rl.trainer.setup import ConfigError, policy_config

log = logging.getLogger("mcore_rl")


def load_policies(
    cfg: MainConfig, model_dir: Path, dtype: str, algorithm: Algorithm
) -> tuple[Policy, Any, Any]:
    """(policy, ref or None, ewma or None), initial weights loaded (model.mcore_ckpt or the HF folder)."""
    from mcore_rl.checkpoint_io import load_dist_checkpoint

    pcfg = policy_config(cfg, dtype)
    policy = Policy(model_dir, pcfg)
    _log_packing(policy, cfg.trainer.pack_rows, dtype)  # one line: packed or padded, and why
    ref = None
    if algorithm.needs_ref_logp and not cfg.model.lora.enabled:
        ref = Policy(model_dir, policy_config(cfg, dtype), trainable=False)
    for pol in filter(None, (policy, ref)):
        if cfg.model.mcore_ckpt:
            load_dist_checkpoint(cfg.model.mcore_ckpt, pol.model)
            pol._sync_main_params()
        else:
            pol.load_hf(model_dir)
    _load_check(policy, model_dir, cfg.model.load_check, from_hf=not cfg.model.mcore_ckpt)
    if algorithm.needs_ref_logp and cfg.model.lora.enabled:
        from mcore_rl.policy.lora import BasePolicyView

        ref = BasePolicyView(policy)  # LoRA: the reference is the policy itself with its adapters off
    ewma = None
    if algorithm.needs_prox_logp:
        from mcore_rl.algorithms import EwmaWeights

        ewma = EwmaWeights(list(policy.model.parameters()), beta=algorithm.config.ewma_beta)
    return policy, ref, ewma


def _log_packing(policy: Policy, setting: str, dtype: str) -> None:
    from mcore_rl.policy.packing import can_pack
    from mcore_rl.trainer.setup import resolve_pack_rows

    on, why = policy.cfg.packed, resolve_pack_rows(setting, dtype)[1]
    if on and not can_pack(policy.gpt):
        log.warning(f"micro-batches: padded ({why}, but this model cannot pack: pipeline or context parallelism, "
                    "sequence parallelism or Transformer Engine attention; policy/packing.can_pack)")
    else:
        log.warning(f"micro-batches: {'rows packed without pad tokens' if on else 'padded rows'} ({why})")


def _load_check(policy: Policy, model_dir: Path, lc: Any, from_hf: bool) -> None:
    """Megatron vs transformers logits right after the initial weights are loaded (convert/load_check.py)."""
    from mcore_rl.convert.load_check import run_load_check

    res = run_load_check(policy, model_dir, lc, from_hf=from_hf)
    log.warning(res.line(lc.tol))
    if res.ran and not res.max_abs_diff <= lc.tol:
        raise ConfigError(
            f"{res.line(lc.tol)}: the {policy.args.architecture} adapter's weight mapping "
            f"does not reproduce {model_dir}; refusing to train"
        )


def as_kwargs(settings: Any) -> dict[str, Any]:
    """A settings dataclass as constructor keyword arguments (nested settings as dicts, values copied): how the
    rollout settings reach engines, whose constructors take no catch-all, so each field handed over is used."""
    out = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        out[f.name] = as_kwargs(value) if dataclasses.is_dataclass(value) else copy.deepcopy(value)
    return out


def make_engine(
    rollout: Any, schedule_cls: type, model_dir: Path, dtype: str, deterministic: bool, seed: int
) -> Any:
    """Rank 0's engine. Every rollout setting but the trainer's weight-sync keys is a constructor argument of
    the engine `rollout.engine` names; the schedule may adjust them (staged: SGLang's memory saver)."""
    from mcore_rl.policy.precision import engine_dtype
    from mcore_rl.rollout.protocol import build_engine
    from mcore_rl.rollout.sglang.preflight import engine_determinism
    from mcore_rl.rollout.weight_sync.transports import TRAINER_KEYS

    options = as_kwargs(rollout)
    name = options.pop("engine")
    for key in TRAINER_KEYS:
        options.pop(key, None)
    options = engine_determinism(
        schedule_cls.engine_options(options), deterministic
    )  # seeded for a determ. run
    if "dtype" in options:  # auto: the engine runs in the trainer's (resolved) dtype
        options["dtype"] = engine_dtype(options["dtype"], dtype)
    engine = build_engine(name, model_path=str(model_dir), seed=seed, **options)
    if options.get("worker_urls"):
        log.warning(
            "rollout engine %s: /generate via %s; weight updates and control calls to %s",
            name,
            options.get("router_url") or "the workers",
            ", ".join(options["worker_urls"]),
        )
    return engine
