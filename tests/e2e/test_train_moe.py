"""`mcore-rl-train model=tiny_moe` end to end: single process and torchrun EP=2 exit 0, the synced embedded engine
(transformers' Qwen3-MoE) reproduces the policy's log-probs; the load-time logits check catches a deliberately broken
adapter mapping; an HF config field the adapter does not know is refused at training start in one line."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from tests.conftest import run_train_batch
from tests.convert.conftest import qwen3_moe_config, save_random_model
from tests.e2e.test_train_tiny import records, run

pytestmark = pytest.mark.e2e
FAST = ["model=tiny_moe", "eval.num_prompts=4", "eval.samples_per_prompt=2", "trainer.prompts_per_update=2",
        "trainer.samples_per_prompt=2", "trainer.max_new_tokens=8", "logging.progress=false",
        # random model, all rewards 0: an entropy bonus makes step 1 move the weights that step 2's engine samples with
        "algorithm.entropy_coef=0.01", "optim.lr=1e-3", "algorithm.updates_per_rollout=1", "trainer.steps=2"]


def _check_two_steps(run_dir, stderr: str) -> list[dict]:
    recs = records(run_dir)
    assert [r["step"] for r in recs] == [1, 2]
    assert recs[0]["grad_norm"] > 1e-4 and recs[1]["weight_version"] == 1.0
    # step 2 was sampled by the engine after weight sync: its log-probs equal the policy's (mean |diff| per token)
    assert recs[1]["train_rollout_logprob_abs_diff"] < 1e-5
    loads = [v for k, v in recs[0].items() if k.startswith("moe_load_e")]
    assert len(loads) == 8 and abs(sum(loads) - 1) < 1e-6
    line = next(ln for ln in stderr.splitlines() if "load check:" in ln)
    assert line.rstrip().endswith("OK") and float(line.split("max_abs_logit_diff=")[1].split()[0]) < 1e-4
    return recs


@pytest.fixture(scope="module")
def batch(tmp_path_factory) -> dict:
    """The two-step run and the refused HF config, in one interpreter (tests/train_batch.py).
    name -> (run folder, result)."""
    root = tmp_path_factory.mktemp("train_moe")
    hf = save_random_model(root / "hf", qwen3_moe_config())
    cfg = json.loads((hf / "config.json").read_text())
    cfg["attn_logit_softcapping"] = 30.0
    (hf / "config.json").write_text(json.dumps(cfg))
    runs = {"two_steps": [*FAST, f"run.dir={root / 'two_steps'}"],
            "unknown_field": ["model=hf", f"model.hf_path={hf}", f"run.dir={root / 'unknown_field'}"]}
    results = run_train_batch(list(runs.values()), root)
    return {name: (root / name, res) for name, res in zip(runs, results)}


def test_tiny_moe_two_steps_single_process(batch):
    tmp_path, proc = batch["two_steps"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    _check_two_steps(tmp_path, proc.stderr)
    from mcore_rl.models.hf_io import HFReader

    exported = HFReader(tmp_path / "hf").names()  # the HF export gathered every expert, named one by one
    assert sum(".mlp.experts." in n for n in exported) == 2 * 8 * 3


@pytest.mark.multiproc
@pytest.mark.slow  # ~20 s on a quiet 2-core machine
def test_tiny_moe_two_steps_torchrun_ep2(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "mcore_rl.train", *FAST, "parallel=ep2", "model.load_check.enabled=true",
           "model.moe.aux_loss_coeff=0.01", f"run.dir={tmp_path}"]
    proc = run(cmd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _check_two_steps(tmp_path, proc.stderr)


BROKEN = textwrap.dedent("""
    import sys
    from mcore_rl.models import qwen3_moe
    orig = qwen3_moe.Qwen3MoeFamily.to_mcore

    def swapped_gate_up(self, a, name, get_hf):  # a deliberately broken mapping: [up; gate] instead of [gate; up]
        t = orig(self, a, name, get_hf)
        if name.endswith("local_experts.3.linear_fc1.weight"):
            gate, up = t.chunk(2, dim=0)
            t = __import__("torch").cat([up, gate])
        return t

    qwen3_moe.Qwen3MoeFamily.to_mcore = swapped_gate_up
    sys.argv = ["mcore-rl-train", *sys.argv[1:]]
    from mcore_rl.train import main
    main()
""")


BROKEN_BASE = [sys.executable, "-c", BROKEN, *FAST, "eval.num_prompts=0", "trainer.export_hf=false"]


@pytest.mark.slow  # ~20 s quiet
def test_load_check_can_be_turned_off(tmp_path):
    off = run([*BROKEN_BASE, "trainer.steps=0", "model.load_check.enabled=false", f"run.dir={tmp_path}"])
    assert off.returncode == 0, off.stderr[-3000:]
    assert "load check skipped: model.load_check.enabled=false" in off.stderr


def test_load_check_catches_broken_mapping(tmp_path):
    base = BROKEN_BASE
    on = run([*base, "model.load_check.tol=1e-3", f"run.dir={tmp_path / 'on'}"])
    assert on.returncode == 2, on.stderr[-3000:]
    last = config_error_line(on.stderr)
    assert last.startswith("config error: load check:") and "FAIL" in last and "Qwen3MoeForCausalLM" in last
    assert float(last.split("max_abs_logit_diff=")[1].split()[0]) > 1e-3
    assert not records(tmp_path / "on")  # stopped before training


def config_error_line(stderr: str) -> str:
    """The one `config error:` line, with no traceback. Library warnings may follow it on stderr (a CUDA build of
    torch on a CPU machine logs one from torch.utils.cpp_extension at exit), so it need not be the last line."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [ln for ln in stderr.splitlines() if ln.startswith("config error:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def test_unknown_config_field_refused_at_training_start(batch):
    _, proc = batch["unknown_field"]
    assert proc.returncode == 2
    assert config_error_line(proc.stderr) == ("config error: config field attn_logit_softcapping=30.0 is unknown to the "
                       "Qwen3MoeForCausalLM adapter (it may change the model's math); refusing rather than ignoring it")
