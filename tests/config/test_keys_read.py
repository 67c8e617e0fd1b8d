"""Every field a typed config dataclass declares is read by running code, and every key of every composed group
option is set through the CLI by some test.

"Read" is measured, not guessed: conftest.py turns on mcore_rl/config_reads.py for the whole session, which
records each (class, field) that product code outside validation reads, in this process and in every CLI run,
torchrun rank and server the session starts. These tests run last, so they see what the whole session read; a
class no test of this session exercised is skipped with that reason (run tests/config, or more, to cover it).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_rl import config_reads as reads
from tests.config.keyscan import (
    REPO,
    cli_overrides_in_tests,
    compose,
    group_options,
    leaf_keys,
    option_overrides,
)

SCHEMAS = reads.config_classes()

# Declared fields read only on a path tests/config cannot take by itself, each with the path and where it is
# tested (a session that runs that test reads them too).
READ_ELSEWHERE = {
    "Fp8Config": "model.fp8.*: Transformer Engine + CUDA only (tests/gpu)",
    "LoggingConfig.wandb_project": "read only with logging.wandb=true (needs wandb and an account)",
    "OptimSettings.bf16_stochastic_rounding": "read when model.dtype=bf16 (tests/policy/test_bf16.py)",
    "HFDataConfig.split": "read when data.path names a Hugging Face Hub dataset (network)",
    "HFDataConfig.subset": "read when data.path names a Hugging Face Hub dataset (network)",
    "HFDataConfig.revision": "read when data.path names a Hugging Face Hub dataset (network)",
    "SGLangLauncherSettings.router": "read when the trainer launches servers (test_sglang_keys_through_the_cli, slow)",
    "SGLangLauncherSettings.health_timeout_s": "read when servers start (test_sglang_keys_through_the_cli, slow)",
    "SGLangLauncherSettings.max_restarts": "read when servers start (test_sglang_keys_through_the_cli, slow)",
}


def _exempt(cls: type, name: str) -> bool:
    return cls.__name__ in READ_ELSEWHERE or f"{cls.__name__}.{name}" in READ_ELSEWHERE


def _trainer_run(run_dir: Path) -> None:
    """One short trainer CLI run (recorded through the inherited MCORE_RL_CONFIG_READS)."""
    cmd = [
        sys.executable,
        "-m",
        "mcore_rl.train",
        "model=tiny",
        "trainer.steps=1",
        "trainer.prompts_per_update=2",
        "trainer.samples_per_prompt=2",
        "trainer.max_new_tokens=4",
        "eval.num_prompts=2",
        "eval.samples_per_prompt=2",
        "eval.max_new_tokens=4",
        "logging.progress=false",
        "logging.plot=false",
        f"run.dir={run_dir}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict[str, set[int]]:
    """`module.Class.field` -> pids that read it, this session. When no trainer run of this session was recorded
    (this file run on its own), one short run is made here first."""
    out_dir = Path(os.environ[reads.ENV])
    got = reads.read_keys(out_dir)
    if not any(pids - {os.getpid()} for k, pids in got.items() if ".TrainerConfig." in k):
        _trainer_run(tmp_path_factory.mktemp("keys_read") / "run")
        got = reads.read_keys(out_dir)
    return got


def test_child_processes_record(recorded):
    """The trainer's reads arrive from the CLI run's process, not only from this one."""
    trainer = {k: pids for k, pids in recorded.items() if ".TrainerConfig." in k}
    assert any(pids - {os.getpid()} for pids in trainer.values()), sorted(trainer)


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda c: c.__name__)
def test_every_declared_field_is_read(schema, recorded):
    own = [f.name for f in dataclasses.fields(schema) if reads.declaring_class(schema, f.name) is schema]
    if not own:
        pytest.skip(f"{schema.__name__} declares no field of its own")
    if not any(reads.key(schema, n) in recorded for n in own):
        pytest.skip(f"{schema.__name__}: no test of this session exercised it")
    unread = sorted(n for n in own if reads.key(schema, n) not in recorded and not _exempt(schema, n))
    assert not unread, f"{schema.__name__}: declared, read by no run of this session: {unread}"


# Keys no test sets through the CLI, by reason. A new key must be set in a CLI test (test_cli_keys.py) or be
# listed here with why it cannot run on a CPU CI machine.
CLI_EXEMPT = {
    "model.fp8": "Transformer Engine + CUDA only (tests/gpu)",
    "model.transformer_impl": "auto|local on CPU; transformer_engine needs CUDA (tests/gpu)",
    "model.mcore_ckpt": "set by tests/convert through mcore-rl-convert, then model.mcore_ckpt in tests/gpu",
    "model.recompute_activations": "needs TE's checkpointing on GPU to differ (tests/gpu)",
    "logging.wandb": "needs the optional wandb package and an account",
    "logging.wandb_project": "needs the optional wandb package and an account",
    "rollout.nccl": "NCCL weight sync: GPU only",
    "rollout.launcher.gpu_ids": "CUDA_VISIBLE_DEVICES slices: GPU only",
}


def _covered(key: str, tested: set[str]) -> bool:
    parts = key.split(".")
    return any(".".join(parts[:i]) in tested for i in range(1, len(parts) + 1)) or any(
        t.startswith(key + ".") for t in tested
    )  # a dict-valued key (model.tiny) set entry by entry


def test_every_composed_key_is_set_through_the_cli_in_a_test():
    keys: set[str] = set()
    for group, option in group_options():
        keys |= set(leaf_keys(compose(["model=tiny", *option_overrides(group, option)])))
    tested = cli_overrides_in_tests(REPO / "tests")
    untested = sorted(k for k in keys if not _covered(k, tested) and not _covered(k, set(CLI_EXEMPT)))
    algo = [k for k in untested if k.startswith("algorithm.")]
    rest = [k for k in untested if not k.startswith("algorithm.")]
    assert not rest, f"{len(rest)} keys no test sets through the CLI: {rest}"
    assert not algo, f"{len(algo)} algorithm keys no test sets through the CLI: {algo}"
