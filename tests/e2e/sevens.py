"""A tiny random Llama whose token "7" is likely: random-init rewards are all 0, so nothing in the loss depends on
the reward; with this model about half the samples of "What is 3 + 4?" end in 7, so groups have reward variance
(what DAPO dynamic sampling, P3O advantages and the async resume test need) while the model stays tiny."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ANSWER = "7"  # every question is "What is a + b?" with a + b = 7


def sevens_model(out: Path, boost: float = 0.75) -> Path:
    """Write the HF folder (tiny model, tokenizer) to `out`. Every embedding row gets the same offset c (|c| = 1,
    ~6x a row's norm), so the final norm's output is close to c's direction at every position; that shifts every
    logit equally (tied LM head: no effect on sampling) except the "7" row's, which gets `boost` * c more."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mcore_rl.models.source import tiny_model_dir

    tiny = OmegaConf.load(Path(__file__).parents[2] / "hydra_conf" / "model" / "tiny.yaml").tiny
    src = tiny_model_dir(tiny)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src)
    emb = model.get_input_embeddings().weight
    c = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(0))
    c /= c.norm()
    with torch.no_grad():
        emb += c
        emb[tok.convert_tokens_to_ids("7")] += boost * c
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def sevens_data(path: Path, rows: int = 16) -> Path:
    path.write_text("".join(json.dumps({"question": f"What is {i % 8} + {7 - i % 8}? (#{i})", "answer": ANSWER,
                                        "id": f"q{i}"}) + "\n" for i in range(rows)))
    return path
