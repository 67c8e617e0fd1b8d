"""Build every component of a run from the composed Hydra config; fail on bad config before any model exists."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from mcore_rl import fsio
from mcore_rl.config import ConfigError, OptimSettings, algorithm_spec, typed_group, validate
from mcore_rl.distributed import all_ranks_any
from mcore_rl.models.base import family_for, read_hf_config
from mcore_rl.models.moe_spec import validate_moe_parallel
from mcore_rl.models.spec import BuildConfig, Fp8Config, resolve_impl, validate_parallel
from mcore_rl.policy.policy import PolicyConfig

__all__ = ["ConfigError", "algorithm_spec", "validate_config"]  # ConfigError's home is mcore_rl.config (re-exported here)


def validate_config(cfg: DictConfig) -> None:
    """Cheap checks with one-line messages; the heavy objects are built only after these pass. The checks live in
    the groups' dataclasses (mcore_rl/config/, `__post_init__`); this runs them all."""
    validate(cfg)


def build_config(cfg: DictConfig) -> BuildConfig:
    m = cfg.model
    return BuildConfig(dtype=m.dtype, transformer_impl=m.transformer_impl, tp=cfg.parallel.tp, pp=cfg.parallel.pp,
                       sequence_parallel=cfg.parallel.sequence_parallel, fp8=Fp8Config(**m.fp8),
                       recompute_activations=m.recompute_activations, ep=cfg.parallel.ep,
                       moe_aux_loss_coeff=float(m.moe.aux_loss_coeff) if m.moe is not None else 0.0,
                       lm_head_fp32=m.lm_head_fp32, compile=m.compile)


def policy_config(cfg: DictConfig) -> PolicyConfig:
    return PolicyConfig(build=build_config(cfg), optim=typed_group(cfg, "optim", OptimSettings),
                        decay_steps=max(1, cfg.trainer.steps), token_budget=cfg.trainer.token_budget,
                        seed=int(cfg.seed))


def tiny_model_dir(tiny: DictConfig, cache: Path | None = None) -> Path:
    """A random tiny Llama with the SmolLM2 tokenizer, cached by its config hash (written atomically)."""
    from mcore_rl.models.smollm2 import DEFAULT_CACHE, materialize_smollm2

    spec = OmegaConf.to_container(tiny, resolve=True)
    key = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    out = (cache or DEFAULT_CACHE) / f"tiny-{spec.get('model_type', 'llama')}-{key}"
    if (out / "config.json").is_file():
        return out
    # every process may race here (before torch.distributed exists): the atomic rename decides the winner
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = materialize_smollm2()
    tok = AutoTokenizer.from_pretrained(src)
    seed = spec.pop("seed", 0)
    likely, boost = spec.pop("likely_token", None), spec.pop("likely_boost", 0.75)  # models/tiny_task.py
    model_type = spec.pop("model_type", "llama")  # any transformers model type the families cover
    config = AutoConfig.for_model(model_type, vocab_size=len(tok), tie_word_embeddings=True,
                                  max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if likely is not None:
        from mcore_rl.models.tiny_task import make_token_likely

        make_token_likely(model, tok, str(likely), float(boost), seed)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    fsio.publish_new(tmp, out)  # racing processes: the first rename wins, the others discard their copy
    return out


def resolve_model_dir(cfg: DictConfig) -> Path:
    src = cfg.model.source
    if src == "hf" or cfg.model.hf_path:
        p = Path(cfg.model.hf_path)
        if not (p / "config.json").is_file():
            raise ConfigError(f"model.hf_path={p} is not an HF model folder (no config.json)")
        return p
    if src == "tiny":
        return tiny_model_dir(cfg.model.tiny)
    from mcore_rl.models.smollm2 import materialize_smollm2

    return materialize_smollm2()  # atomic: concurrent ranks race safely


def check_model_against_parallel(cfg: DictConfig, model_dir: Path) -> None:
    hf = read_hf_config(model_dir)
    try:
        args = family_for(hf).args(hf)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        validate_parallel(args, cfg.parallel.tp, cfg.parallel.pp, world)
        validate_moe_parallel(args, cfg.parallel.tp, cfg.parallel.ep, world, cfg.parallel.pp,
                              sequence_parallel=bool(cfg.parallel.sequence_parallel))
        resolve_impl(build_config(cfg))
    except (ValueError, RuntimeError) as e:
        raise ConfigError(str(e)) from None


@dataclass
class StopFlag:
    """Set by SIGUSR1/SIGTERM (Slurm preemption); the loop checkpoints and exits at the next round boundary."""

    requested: bool = False
    signals: list[int] = field(default_factory=list)

    def install(self) -> None:
        import signal

        def handler(signum: int, frame: Any) -> None:
            self.requested = True
            self.signals.append(signum)
            # The flag is set; train.sbatch re-sends USR1 until we exit. Ignore the repeats: Python restores
            # SIG_DFL for handled signals at interpreter shutdown, and a repeat then would kill a clean exit.
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)

        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, handler)

    def agreed(self) -> bool:
        """All ranks stop together if any rank was signalled."""
        return all_ranks_any(self.requested)
