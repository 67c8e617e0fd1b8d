"""Two RL updates through `mcore-rl-train model=hf` for the new families (Llama 3.x / linear RoPE, YaRN, Mistral with
a sliding window, Qwen2 with a per-layer window, Llama biases + GELU, Qwen2-MoE / Qwen3-MoE with dense layers), each a tiny random model from transformers' own config class with the SmolLM2 tokenizer. The
contexts are tiny on purpose (original context 32, window 16) so the prompts run past them: the load-time logits
check, the two gradient steps, and the engine's log-probs after weight sync (step 2 samples with step 1's weights)
all see the scaled / windowed positions."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.e2e.test_train_tiny import records, run

pytestmark = pytest.mark.e2e
FAST = ["eval.num_prompts=0", "trainer.prompts_per_update=2", "trainer.samples_per_prompt=2",
        "trainer.max_new_tokens=8", "logging.progress=false", "trainer.export_hf=false",
        # random model, all rewards 0: an entropy bonus makes step 1 move the weights that step 2's engine samples with
        "algorithm.entropy_coef=0.01", "optim.lr=1e-3", "algorithm.updates_per_rollout=1", "trainer.steps=2",
        "model.load_check.enabled=true", "model.dtype=fp32"]
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048)
FAMILIES = {
    "llama3": ("llama", dict(rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                  high_freq_factor=4.0, original_max_position_embeddings=32,
                                                  rope_theta=10000.0))),
    "qwen3-yarn": ("qwen3", dict(head_dim=32, max_position_embeddings=128, rope_parameters=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32, rope_theta=10000.0))),
    "mistral-window": ("mistral", dict(head_dim=16, sliding_window=16)),
    "linear": ("llama", dict(rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=10000.0))),
    # Qwen2 per-layer window: layer 0 full, layer 1 within 16 tokens (max_window_layers=1)
    "qwen2-window": ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    # Qwen3-MoE with a dense layer 0 (mlp_only_layers) and normalised top-k probabilities
    "qwen3-moe-dense": ("qwen3_moe", dict(head_dim=16, moe_intermediate_size=32, num_experts=4,
                                          num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0])),
    "llama-bias-gelu": ("llama", dict(attention_bias=True, mlp_bias=True, hidden_act="gelu_pytorch_tanh")),
    # Qwen2-MoE: gated shared expert, dense layer 0 and MoE layer 1 (decoder_sparse_step=2)
    "qwen2-moe-dense": ("qwen2_moe", dict(moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                          num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2)),
}


def tiny_folder(root: Path, model_type: str, fields: dict) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from mcore_rl.models.smollm2 import materialize_smollm2

    tok = AutoTokenizer.from_pretrained(materialize_smollm2())
    config = AutoConfig.for_model(model_type, **{**SHAPE, **fields}, vocab_size=len(tok), tie_word_embeddings=True,
                                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root)
    tok.save_pretrained(root)
    return root


def _check_two_updates(recs: list[dict], load_check_line: str) -> None:
    assert [r["step"] for r in recs] == [1, 2]
    assert min(r["grad_norm"] for r in recs) > 1e-5 and recs[1]["weight_version"] == 1.0
    # step 2 was sampled by the synced engine (transformers' own model): same log-probs as the policy
    assert recs[1]["train_rollout_logprob_abs_diff"] < 1e-5
    assert load_check_line.rstrip().endswith("OK"), load_check_line
    assert float(load_check_line.split("max_abs_logit_diff=")[1].split()[0]) < 1e-4


def _load_check_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "load check:" in ln]


def _folder(name: str, root: Path) -> Path:
    try:
        return tiny_folder(root, *FAMILIES[name])
    except FileNotFoundError as e:  # no SmolLM2 tokenizer on this machine
        pytest.skip(str(e))


def _two_updates(name: str, tmp_path: Path, launcher: list[str], *extra: str) -> list[dict]:
    hf = _folder(name, tmp_path / "hf")
    run_dir = tmp_path / "run"
    proc = run([*launcher, "-m", "mcore_rl.train", "model=hf", f"model.hf_path={hf}", *FAST, *extra,
                f"run.dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = records(run_dir)
    _check_two_updates(recs, _load_check_lines(proc.stderr)[0])
    return recs


# ~90-110 s each on a loaded 2-core machine; their TP=1 exactness is in tests/convert, their sync in
# test_sync_families.py
SLOW = {"llama-bias-gelu", "qwen2-moe-dense", "linear", "qwen3-moe-dense"}
DEFAULT = [n for n in FAMILIES if n not in SLOW]


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory) -> dict[str, tuple[list[dict], str]]:
    """The default families' runs as one Hydra multirun over model.hf_path: jobs run one after another in one
    process (one torch/Megatron start-up for all; each job builds, trains and tears down its own run), job i in
    sweep folder i. name -> (metrics records, its load-check line)."""
    root = tmp_path_factory.mktemp("families")
    folders = [str(_folder(n, root / n)) for n in DEFAULT]
    sweep = root / "sweep"
    proc = run([sys.executable, "-m", "mcore_rl.train", "-m", "model=hf", f"model.hf_path={','.join(folders)}",
                *FAST, f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=${hydra.job.num}"], timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    checks = _load_check_lines(proc.stderr)
    assert len(checks) == len(DEFAULT), checks
    for i, folder in enumerate(folders):  # job i trained folder i (Hydra keeps the sweep's order)
        assert f"model.hf_path={folder}" in (sweep / str(i) / ".hydra" / "overrides.yaml").read_text()
    return {n: (records(sweep / str(i)), checks[i]) for i, n in enumerate(DEFAULT)}


@pytest.mark.parametrize("name", DEFAULT)
def test_two_updates_through_the_cli(name, default_runs):
    _check_two_updates(*default_runs[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW))
def test_two_updates_through_the_cli_more_families(name, tmp_path):
    _two_updates(name, tmp_path, [sys.executable])


@pytest.mark.multiproc
@pytest.mark.slow  # two ranks on a shared 2-core machine
def test_moe_with_dense_layers_trains_with_ep2_under_torchrun(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    recs = _two_updates("qwen2-moe-dense", tmp_path, torchrun, "parallel=ep2")
    loads = [v for k, v in recs[0].items() if k.startswith("moe_load_e")]
    assert len(loads) == 4 and abs(sum(loads) - 1) < 1e-6  # the one MoE layer's 4 experts, all ranks counted
