"""One HF-folder writer (mcore_rl/models/hf_io.py): a run's `hf/` export, weight-sync versions and the converter
carry every side file the source model had, tokenizer files included (a missing `added_tokens.json` changes how
the exported model tokenizes)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mcore_rl.models.hf_io import side_files, write_hf_folder
from tests.evaluation.conftest import run_module

# what other tokenizer kinds ship next to tokenizer.json (the tiny model's SmolLM2 tokenizer has none of them)
EXTRA = {
    "added_tokens.json": json.dumps({"<|im_start|>": 1, "<|im_end|>": 2}),
    "special_tokens_map.json": json.dumps({"eos_token": "<|im_end|>"}),
    "tokenizer.model": "sentencepiece model bytes",
    "qwen.tiktoken": "IQ== 0\n",
}


@pytest.fixture
def source_model(tmp_path):
    """The tiny model's HF folder plus the extra side files, and a weight file that must not count as one."""
    from omegaconf import OmegaConf

    from mcore_rl.models.source import tiny_model_dir
    from tests.conftest import REPO

    src = tmp_path / "src"
    shutil.copytree(tiny_model_dir(OmegaConf.load(REPO / "hydra_conf" / "model" / "tiny.yaml").tiny), src)
    for name, text in EXTRA.items():
        (src / name).write_text(text)
    return src


def _assert_same_side_files(src, out):
    names = [p.name for p in side_files(src)]
    assert {*EXTRA, "config.json", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    assert not any(n.endswith(".safetensors") for n in names)
    for name in names:
        assert (out / name).read_bytes() == (src / name).read_bytes(), name


def test_side_files_are_every_non_weight_file(source_model, tmp_path):
    (source_model / "model.safetensors.index.json").write_text("{}")
    (source_model / "pytorch_model.bin").write_bytes(b"0")
    (source_model / ".gitattributes").write_text("*")
    names = {p.name for p in side_files(source_model)}
    assert names == {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        *EXTRA,
    }
    out = write_hf_folder([("w", torch.arange(4.0))], tmp_path / "v1", config_dir=source_model)
    _assert_same_side_files(source_model, out)
    assert sorted(p.name for p in out.iterdir()) == sorted([*names, "model.safetensors"])


def test_exported_run_has_every_side_file_of_its_model(source_model, tmp_path):
    """A real run (no update; the end-of-run export still writes hf/) started from the folder above."""
    run_dir = tmp_path / "run"
    proc = run_module(
        "mcore_rl.train",
        "model=tiny",
        "model.dtype=fp32",
        f"model.hf_path={source_model}",
        "trainer.steps=0",
        "eval.num_prompts=0",
        "logging.progress=false",
        "logging.plot=false",
        "logging.tensorboard=false",
        f"run.dir={run_dir}",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    _assert_same_side_files(source_model, run_dir / "hf")
    from mcore_rl.models.hf_io import HFReader

    with HFReader(run_dir / "hf") as exported, HFReader(source_model) as src:  # untrained: the same weights
        assert sorted(exported.names()) == sorted(src.names())
        name = "model.embed_tokens.weight"
        assert torch.equal(exported.get(name), src.get(name))
