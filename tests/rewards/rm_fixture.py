"""A real (small) reward model for tests: SmolLM2-135M-Instruct's trunk under a seeded one-logit score head.

`make_smollm2_rm(folder, seed=0)` writes an HF `LlamaForSequenceClassification` folder (config with
`num_labels=1`, the tokenizer and its ChatML chat template, fp32 safetensors). Why these choices:
- the trunk is the SmolLM2 folder the other tests use (tests/conftest.py `smollm2_dir`), so no hub is needed and the
  scores come from a real 30-layer model, not a random toy;
- the score head is drawn from a `torch.Generator` seeded with `seed` (N(0, 1/hidden)), so two calls with the same
  seed give the same model bit for bit, and different seeds different scores;
- `pad_token_id` is `<|endoftext|>` (id 0), a token no rendered chat row contains: HF then scores the last token of
  every unpadded row, as SGLang's `/classify` does (last-token pooling). SmolLM2's own pad token is `<|im_end|>`, which
  ends every chat turn: with it HF would skip over a row's final `<|im_end|>` and score an earlier position.
A folder already written with the same seed is reused (the marker file holds the seed).
"""

from __future__ import annotations

from pathlib import Path

PAD_TOKEN = "<|endoftext|>"
MARKER = "mcore_rl_test_rm_seed.txt"


def make_smollm2_rm(folder: str | Path, seed: int = 0) -> Path:
    """Write (or reuse) the test RM in `folder` and return the folder."""
    folder = Path(folder)
    if (folder / MARKER).is_file() and (folder / MARKER).read_text().strip() == str(seed):
        return folder
    import torch
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    from mcore_rl.models.smollm2 import materialize_smollm2

    src = materialize_smollm2()
    tok = AutoTokenizer.from_pretrained(src)
    tok.pad_token = PAD_TOKEN
    model = LlamaForSequenceClassification.from_pretrained(
        src, num_labels=1, dtype=torch.float32, pad_token_id=tok.pad_token_id
    )
    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    with torch.no_grad():
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=gen) / hidden**0.5)
    model.config.pad_token_id = tok.pad_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / MARKER).write_text(f"{seed}\n")
    return folder


def hf_scores(folder: str | Path, rows: list[list[int]], label: int = 0) -> list[float]:
    """The reference: HF's own forward over each token row (one at a time, no padding), logit column `label`."""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return [float(model(torch.tensor([r])).logits[0, label]) for r in rows]


def make_tokenizer_only_rm(folder: str | Path, src: str | Path, num_labels: int = 2) -> Path:
    """`src`'s tokenizer and chat template under a `num_labels`-logit classifier's config.json, without weights:
    enough for the rm reward's checks and rendering when the scores come from a stand-in server or a fake
    scorer (fast: no 540 MB checkpoint written)."""
    import json
    import shutil

    folder, src = Path(folder), Path(src)
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / name, folder / name)
    config = {
        "architectures": ["LlamaForSequenceClassification"],
        "id2label": {str(i): f"LABEL_{i}" for i in range(num_labels)},
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder
