"""Bad inputs give one-line errors naming the problem; interrupted conversions never publish an output."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mcore_rl.convert.cli import main
from tests.convert.conftest import CLI, REPO, assert_same_hf_tensors, run_cli, run_python, save_random_model

pytestmark = pytest.mark.convert


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ")
    return err[-1]


def _copy_hf(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture_lists_supported(qwen2_dir, tmp_path, capsys):
    hf = _copy_hf(qwen2_dir, tmp_path / "gpt2")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (hf / "config.json").write_text(json.dumps(cfg))
    assert main(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "o")]) == 2
    line = _err(capsys)
    assert "GPT2LMHeadModel" in line
    assert all(a in line for a in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"))
    assert not (tmp_path / "o").exists()


def test_missing_tensor_is_named(qwen2_dir, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    hf = _copy_hf(qwen2_dir, tmp_path / "hf")
    state = load_file(hf / "model.safetensors")
    del state["model.layers.2.self_attn.k_proj.bias"]
    save_file(state, hf / "model.safetensors", metadata={"format": "pt"})
    assert main(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "o")]) == 2
    line = _err(capsys)
    assert "model.layers.2.self_attn.k_proj.bias" in line and "missing" in line and "(32,)" in line


def test_shape_mismatch_names_tensor_and_both_shapes(qwen2_dir, tmp_path, capsys):
    hf = _copy_hf(qwen2_dir, tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["intermediate_size"] = 192  # weights were saved with 160
    (hf / "config.json").write_text(json.dumps(cfg))
    assert main(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "o")]) == 2
    line = _err(capsys)
    assert "model.layers.0.mlp.gate_proj.weight" in line
    assert "(160, 64)" in line and "(192, 64)" in line


def test_bad_parallel_layout_is_refused(qwen2_dir, tmp_path, capsys):
    assert main(["hf-to-mcore", "--hf", str(qwen2_dir), "--out", str(tmp_path / "o"), "--tp", "3"]) == 2
    assert "tp=3" in _err(capsys)


def test_existing_output_needs_force(qwen2_dir, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main(["hf-to-mcore", "--hf", str(qwen2_dir), "--out", str(out)]) == 2
    assert "already exists" in _err(capsys)
    assert (out / "keep.txt").is_file()


def test_incomplete_checkpoint_is_refused(tmp_path, capsys):
    ck = tmp_path / "ck"
    ck.mkdir()
    assert main(["mcore-to-hf", "--ckpt", str(ck), "--out", str(tmp_path / "o")]) == 2
    assert "not a complete" in _err(capsys)
    assert main(["verify", "--hf", str(ck), "--ckpt", str(ck)]) == 2
    assert "not a complete" in _err(capsys)


def test_bad_max_shard_size(tmp_path, capsys):
    assert main(["mcore-to-hf", "--ckpt", str(tmp_path), "--out", str(tmp_path / "o"),
                 "--max-shard-size", "lots"]) == 2
    assert "--max-shard-size 'lots'" in _err(capsys)


def test_export_refuses_existing_output_unless_force(qwen2_ckpt, qwen2_dir, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main(["--quiet", "mcore-to-hf", "--ckpt", str(qwen2_ckpt), "--out", str(out)]) == 2
    assert "--force" in _err(capsys) and (out / "keep.txt").is_file()
    assert main(["--quiet", "mcore-to-hf", "--ckpt", str(qwen2_ckpt), "--out", str(out), "--force"]) == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


@pytest.mark.slow
def test_rank_error_comes_back_as_one_line(qwen2_ckpt, tiny_llama_dir, tmp_path):
    """A failure inside spawned ranks (here: loading a Qwen2 checkpoint into a Llama-shaped model) is reported
    as one line with exit code 2, and no worker survives."""
    bare = tmp_path / "bare"
    shutil.copytree(qwen2_ckpt, bare)
    shutil.rmtree(bare / "hf")  # like a training checkpoint: the model shape comes from --hf
    meta = json.loads((bare / "complete.json").read_text())
    (bare / "complete.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "hf_config"}))
    proc = run_cli("verify", "--hf", tiny_llama_dir, "--ckpt", bare, "--tp", 2, rc=2)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rank ") and "linear_fc1" in last, proc.stderr[-2000:]


def test_export_with_wrong_config_names_tensor_and_shapes(qwen2_ckpt, tmp_path, capsys):
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    cfg = json.loads((qwen2_ckpt / "hf" / "config.json").read_text())
    cfg["hidden_size"] = 96
    (cfg_dir / "config.json").write_text(json.dumps(cfg))
    assert main(["mcore-to-hf", "--ckpt", str(qwen2_ckpt), "--out", str(tmp_path / "o"),
                 "--hf-config", str(cfg_dir)]) == 2
    line = _err(capsys)
    assert "embedding.word_embeddings.weight" in line and "(1280, 64)" in line and "(1100, 96)" in line
    assert not (tmp_path / "o").exists()


def test_export_failure_midway_publishes_nothing(qwen2_ckpt, tmp_path, monkeypatch):
    from mcore_rl.convert import dist_reader

    calls = {"n": 0}
    original = dist_reader.DistCheckpointReader.read

    def flaky(self, boxes):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("injected: disk went away")
        return original(self, boxes)

    monkeypatch.setattr(dist_reader.DistCheckpointReader, "read", flaky)
    out = tmp_path / "o"
    with pytest.raises(OSError, match="injected"):
        main(["--quiet", "mcore-to-hf", "--ckpt", str(qwen2_ckpt), "--out", str(out)])
    assert calls["n"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither the output nor a staging dir


def test_failure_after_save_publishes_nothing(qwen2_dir, tmp_path):
    """The most dangerous moment: Megatron has written a complete checkpoint (with its marker) in the staging
    dir, then the conversion dies before publishing. --out must not appear; the staging dir is removed."""
    out = tmp_path / "o"
    code = f"""
import sys
import mcore_rl.checkpoint_io as io
orig = io.save_dist_checkpoint
def save_then_fail(*a, **k):
    orig(*a, **k)
    raise RuntimeError("injected after save")
io.save_dist_checkpoint = save_then_fail
from mcore_rl.convert.cli import main
sys.exit(main(["--quiet", "hf-to-mcore", "--hf", {str(qwen2_dir)!r}, "--out", {str(out)!r}]))
"""
    proc = run_python(code)
    assert proc.returncode != 0 and "injected after save" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_killed_conversion_leaves_no_complete_checkpoint(tmp_path):
    """SIGKILL the whole conversion (2 spawned ranks) while it writes; rerun without --force succeeds."""
    from tests.conftest import tiny_llama_config

    hf = save_random_model(tmp_path / "hf", tiny_llama_config(hidden_size=384, intermediate_size=1536,
                                                             num_hidden_layers=6, num_attention_heads=6,
                                                             num_key_value_heads=2, vocab_size=8192))
    out = tmp_path / "ckpt"
    staging = tmp_path / ".ckpt.partial.tmp"
    cmd = [sys.executable, *CLI, "--quiet", "hf-to-mcore", "--hf", str(hf), "--out", str(out), "--tp", "2"]
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    try:
        deadline = time.time() + 240
        while not staging.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.002)
        os.killpg(proc.pid, signal.SIGSTOP)  # freeze every rank right after writing started
        assert staging.exists(), f"conversion never started writing (rc={proc.poll()})"
        assert not out.exists()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    assert not out.exists()
    assert not any((p / "complete.json").is_file() for p in tmp_path.iterdir() if p.is_dir() and p.name != "hf")
    run_cli("hf-to-mcore", "--hf", hf, "--out", out)  # stale staging is swept, no --force needed
    assert (out / "complete.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]
    back = tmp_path / "back"
    assert main(["--quiet", "mcore-to-hf", "--ckpt", str(out), "--out", str(back)]) == 0
    assert assert_same_hf_tensors(hf, back) == 6 * 9 + 2
