"""Test-side helpers: launch `mcore-rl-sft`, read a run's numbers, and the transformers hand computation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
CLI = REPO / "mcore_rl" / "sft" / "cli.py"


def sft(args: Sequence[str], env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`mcore-rl-sft ARGS` in a fresh process; the exit code is returned, not asserted."""
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(REPO),
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "mcore_rl.sft.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=REPO,
    )


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return proc


def records(run_dir: Path, kind: str = "metrics") -> list[dict]:
    path = Path(run_dir) / f"{kind}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir)}


def heldout(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["heldout_loss"] for r in records(run_dir, "eval")}


def model_dir_of(overrides: Sequence[str]) -> Path:
    """The HF folder a run with these model overrides starts from (model=tiny: the cached random model)."""
    from mcore_rl.models.source import resolve_model_dir
    from mcore_rl.sft.config import load_sft_config, register_sft_schema
    from tests.config.keyscan import compose

    register_sft_schema()
    return resolve_model_dir(load_sft_config(compose([*overrides, "sft.data.path=x"], "sft")).model)


def examples_of(model_dir: Path, path: Path, chat_template: str | None = None, max_length: int = 2048):
    from transformers import AutoTokenizer

    from mcore_rl.sft.data import load_examples
    from mcore_rl.sft.template import TemplateMasker

    masker = TemplateMasker(AutoTokenizer.from_pretrained(model_dir), chat_template)
    return load_examples(str(path), "sft.data.path", masker, max_length)[0]


def hf_token_mean_nll(model_dir: Path, examples) -> float:
    """Token-mean -log p of the assistant tokens, computed with transformers (fp32, full logits)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    total, count = 0.0, 0.0
    with torch.no_grad():
        for e in examples:
            ids = torch.tensor([e.ids])
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), dim=-1)
            picked = logp.gather(1, ids[0, 1:, None])[:, 0]
            m = torch.tensor(e.mask[1:], dtype=torch.float64)
            total += float(-(picked * m).sum())
            count += float(m.sum())
    return total / count
