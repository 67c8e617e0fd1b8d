"""Which HF folder a run's `model` group names: an HF path, the cached random tiny model, or SmolLM2.

Why here, below the trainer: `mcore-rl-eval` resolves a run directory's base model from its config.yaml the same
way the trainer did when it started the run, without importing the trainer.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mcore_rl import fsio
from mcore_rl.config import ConfigError


def tiny_model_dir(tiny: Mapping[str, Any], cache: Path | None = None) -> Path:
    """A random tiny Llama with the SmolLM2 tokenizer, cached by its config hash (written atomically)."""
    from mcore_rl.models.smollm2 import DEFAULT_CACHE, materialize_smollm2

    spec = {str(k): v for k, v in tiny.items()}  # model.tiny: flat HF config fields
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


def resolve_model_dir(model: Any) -> Path:
    """`model`: the run's `model` group (the typed ModelConfig, or the node of a saved run's config.yaml)."""
    src = model.source
    if src == "hf" or model.hf_path:
        p = Path(model.hf_path)
        if not (p / "config.json").is_file():
            raise ConfigError(f"model.hf_path={p} is not an HF model folder (no config.json)")
        return p
    if src == "tiny":
        return tiny_model_dir(model.tiny)
    from mcore_rl.models.smollm2 import materialize_smollm2

    return materialize_smollm2()  # atomic: concurrent ranks race safely
