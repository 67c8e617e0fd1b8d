"""`mcore-rl-sft` end to end on the tiny model (fp32): the loss is the transformers hand computation, a SIGKILLed
run resumes to the same losses, TP=2 / PP=2 / DP=2 reproduce TP=1, and RL starts from the SFT run (HF export or
Megatron checkpoint) with the SFT model's numbers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mcore_rl.sft.run import step_rows
from tests.sft.conftest import addition_rows, write_jsonl
from tests.sft.helpers import (
    examples_of,
    heldout,
    hf_token_mean_nll,
    losses,
    model_dir_of,
    ok,
    records,
    sft,
)

STEPS = 4


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("sft_data")
    return {
        "train": write_jsonl(d / "train.jsonl", addition_rows(12)),
        "heldout": write_jsonl(d / "heldout.jsonl", addition_rows(4, start=100)),
    }


def base_args(data: dict[str, Path], run_dir: Path) -> list[str]:
    return [
        "model=tiny",
        f"sft.data.path={data['train']}",
        f"sft.data.heldout_path={data['heldout']}",
        f"sft.steps={STEPS}",
        "sft.batch_size=4",
        "sft.token_budget=64",
        "sft.max_length=128",
        "sft.save_every=2",
        "sft.keep_checkpoints=0",
        "sft.eval_every=2",
        "sft.pack_rows=false",
        "optim.lr=1e-3",
        "seed=7",
        "logging.progress=false",
        "logging.tensorboard=false",
        f"run.dir={run_dir}",
    ]


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> Path:
    """The TP=1 run every other run is compared with."""
    run_dir = tmp_path_factory.mktemp("sft_ref") / "run"
    ok(sft(base_args(data, run_dir)))
    return run_dir


def test_losses_equal_the_transformers_hand_computation(reference, data):
    model_dir = model_dir_of(["model=tiny"])
    train = examples_of(model_dir, data["train"])
    held = examples_of(model_dir, data["heldout"])
    first = [train[i] for i in step_rows(0, len(train), 4, 7)]
    got = losses(reference)
    assert sorted(got) == list(range(1, STEPS + 1)) and got[4] < got[1]
    assert got[1] == pytest.approx(hf_token_mean_nll(model_dir, first), abs=1e-5)  # before any update
    evals = heldout(reference)
    assert sorted(evals) == [0, 2, 4]
    assert evals[0] == pytest.approx(hf_token_mean_nll(model_dir, held), abs=1e-5)
    # the export is the trained model: transformers on run.dir/hf gives the run's final held-out loss
    assert evals[4] == pytest.approx(hf_token_mean_nll(reference / "hf", held), abs=1e-5)
    assert evals[4] < evals[0] - 0.05
    assert (reference / "curves.png").stat().st_size > 0
    assert {"lr", "grad_norm", "tokens_per_s", "loss"} <= set(records(reference)[-1])


def test_sigkill_and_resume_reproduce_the_losses(reference, data, tmp_path):
    run_dir = tmp_path / "run"
    args = base_args(data, run_dir)
    killed = sft(args, env={"MCORE_RL_CRASH_AT": "after_latest:2"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert sorted(losses(run_dir)) == [1, 2] and not (run_dir / "hf").exists()
    resumed = ok(sft(args))
    assert "resumed from" in resumed.stderr and "step 2" in resumed.stderr
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3, 4]  # steps 3, 4 trained once, after the restart
    ref = losses(reference)
    for step, value in losses(run_dir).items():
        assert value == pytest.approx(ref[step], abs=1e-6), step
    assert heldout(run_dir)[4] == pytest.approx(heldout(reference)[4], abs=1e-6)


LAYOUTS = {"tp2": ["parallel=tp2"], "pp2": ["parallel.pp=2"], "dp2": []}


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [
    "tp2",
    pytest.param("pp2", marks=pytest.mark.slow),  # slow for the default suite's time; tp2 runs there
    pytest.param("dp2", marks=pytest.mark.slow),  # DP: the same weights as RL's aggregation
])  # fmt: skip
def test_parallel_layouts_reproduce_tp1(reference, data, tmp_path, layout):
    from tests.conftest import run_torchrun
    from tests.sft.helpers import CLI

    run_dir = tmp_path / "run"
    args = [*base_args(data, run_dir), *LAYOUTS[layout], "sft.export_hf=false"]
    run_torchrun(2, CLI, *args, timeout=600)
    ref, got = losses(reference), losses(run_dir)
    assert sorted(got) == sorted(ref)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=2e-5), (layout, step, got, ref)
    for step, value in heldout(reference).items():
        assert heldout(run_dir)[step] == pytest.approx(value, abs=2e-5), (layout, step)


def test_rl_and_sft_start_from_the_sft_run(reference, data, tmp_path):
    """RL's two ways in: the HF export (model.hf_path) and the Megatron checkpoint (model.mcore_ckpt). Each
    loads the SFT model: its held-out loss at step 0 is the SFT run's final one, and the RL trainer starts from
    the export with Megatron's logits equal to transformers' on it (its load check)."""
    final = heldout(reference)[STEPS]
    template = tmp_path / "chatml.jinja"
    shutil.copy(reference / "hf" / "chat_template.jinja", template)
    for name, model in {
        "hf": ["model=hf", f"model.hf_path={reference / 'hf'}", "model.dtype=fp32"],
        "mcore": ["model=tiny", f"model.mcore_ckpt={reference / 'checkpoints' / 'step_000004'}"],
    }.items():
        run_dir = tmp_path / name
        args = [
            *base_args(data, run_dir),
            *model,
            "sft.steps=0",
            "sft.export_hf=false",
            "sft.resume=never",
            f"sft.data.chat_template={template}",
            "logging.plot=false",
        ]
        ok(sft(args))
        assert heldout(run_dir) == {0: pytest.approx(final, abs=1e-5)}, name
        assert len(records(run_dir, "eval")) == 1  # evaluated once: no step, no second evaluation at the end
    from tests.conftest import run_train_batch

    rl_common = ["trainer.steps=1", "trainer.prompts_per_update=2", "trainer.samples_per_prompt=2",
                 "trainer.max_new_tokens=4", "trainer.export_hf=false", "eval.num_prompts=0",
                 "logging.progress=false", "logging.plot=false"]  # fmt: skip
    from_hf = ["model=hf", f"model.hf_path={reference / 'hf'}", "model.dtype=fp32", "model.load_check.enabled=true",
               "model.load_check.tol=1e-4", f"run.dir={tmp_path / 'rl_hf'}"]  # fmt: skip
    from_ckpt = ["model=tiny", f"model.mcore_ckpt={reference / 'checkpoints' / 'step_000004'}",
                 f"run.dir={tmp_path / 'rl_mcore'}"]  # fmt: skip
    runs = run_train_batch([[*from_hf, *rl_common], [*from_ckpt, *rl_common]], tmp_path)
    for rl in runs:
        assert rl.returncode == 0, rl.stderr[-4000:]
    # Megatron's logits from the export equal transformers' on it (which gave the SFT run's final loss above)
    line = next(ln for ln in runs[0].stderr.splitlines() if "load check:" in ln)
    assert line.endswith("OK") and float(line.split("max_abs_logit_diff=")[1].split()[0]) <= 1e-4, line


def test_packed_rows_reproduce_padded_rows(reference, data, tmp_path):
    """sft.pack_rows=true (Megatron's THD layout, no pad tokens; the default on CUDA bf16) gives the padded
    run's losses."""
    run_dir = tmp_path / "run"
    ok(sft([*base_args(data, run_dir), "sft.pack_rows=true", "sft.export_hf=false", "logging.plot=false"]))
    ref, got = losses(reference), losses(run_dir)
    assert sorted(got) == sorted(ref)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=2e-5), (step, got, ref)
