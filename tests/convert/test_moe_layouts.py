"""MoE layouts beyond "every layer routes": Qwen3-MoE with dense layers (`mlp_only_layers`, `decoder_sparse_step`)
and Qwen2-MoE (shared expert with a sigmoid gate, QKV bias), tiny, from transformers' own config classes: converted,
logits equal transformers' within 1e-5 (fp32) on a short and a 1100-token prompt, at TP=2, PP=2 and EP=2 too
(slow), and back to HF bit-exact."""

from __future__ import annotations

import pytest

from mcore_rl.convert.cli import main
from mcore_rl.models.base import family_for
from tests.convert.conftest import (
    assert_same_hf_tensors,
    max_logit_diff,
    qwen3_moe_config,
    run_cli,
    run_cli_batch,
    save_random_model,
)

pytestmark = pytest.mark.convert
slow = pytest.mark.slow
TOL = 1e-5  # fp32; measured <= 1.1e-6 on 1100 tokens (docs/models.md: why MoE is exact)


def qwen3_moe_dense_config():
    """4 layers, layer 1 dense by mlp_only_layers; normalised top-k probabilities (Qwen3-30B-A3B's setting)."""
    return qwen3_moe_config(mlp_only_layers=[1])


def qwen3_moe_sparse_step_config():
    """decoder_sparse_step=2: layers 1 and 3 route, 0 and 2 are dense (and mlp_only_layers=[3] makes 3 dense too);
    raw top-k probabilities (norm_topk_prob=false)."""
    return qwen3_moe_config(decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False)


def qwen2_moe_config():
    """Qwen1.5-MoE shape at tiny size: 8 experts top-2 without renormalisation, a gated shared expert (48 wide),
    QKV bias, decoder_sparse_step=2 (dense layers 0 and 2)."""
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                          shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                          decoder_sparse_step=2, vocab_size=512, tie_word_embeddings=False,
                          max_position_embeddings=2048, rms_norm_eps=1e-6)


CONFIGS = {"qwen3-moe-dense": qwen3_moe_dense_config, "qwen3-moe-step2": qwen3_moe_sparse_step_config,
           "qwen2-moe": qwen2_moe_config}


def test_dense_layers_follow_hf_rule():
    for make, dense in ((qwen3_moe_dense_config, (1,)), (qwen3_moe_sparse_step_config, (0, 2, 3)),
                        (qwen2_moe_config, (0, 2))):
        hf = {**make().to_dict(), "architectures": [type(make()).__name__.replace("Config", "ForCausalLM")]}
        a = family_for(hf).args(hf)
        assert a.moe.dense_layers == dense
        names = family_for(hf).mcore_names(a)
        for i in range(4):
            assert (f"decoder.layers.{i}.mlp.linear_fc1.weight" in names) == (i in dense)
            assert (f"decoder.layers.{i}.mlp.router.weight" in names) == (i not in dense)


def _verify_args(hf, ckpt, tokens: int, tol: float, tp: int = 1, pp: int = 1, ep: int = 1) -> list:
    return ["verify", "--hf", hf, "--ckpt", ckpt, "--tokens", tokens, "--tp", tp, "--pp", pp, "--ep", ep,
            "--tol", tol]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict:
    """Each layout converted at TP=1 and checked on the 1100-token prompt, as CLI commands in one interpreter
    (run_cli_batch: one start-up instead of six)."""
    root = tmp_path_factory.mktemp("moe_layouts")
    hf = {n: save_random_model(root / n / "hf", make(), seed=11) for n, make in CONFIGS.items()}
    ckpt = {n: root / n / "ckpt" for n in CONFIGS}
    calls = [["hf-to-mcore", "--hf", hf[n], "--out", ckpt[n]] for n in CONFIGS]
    calls += [_verify_args(hf[n], ckpt[n], 1100, TOL) for n in CONFIGS]
    res = run_cli_batch(calls, root)
    for r in res[: len(CONFIGS)]:
        assert r.returncode == 0, f"{r.args}: {r.stderr[-3000:]}"
    return {"hf": hf, "ckpt": ckpt, "verify": dict(zip(CONFIGS, res[len(CONFIGS):]))}


@pytest.fixture(scope="module")
def converted(layouts):
    return lambda name: (layouts["hf"][name], layouts["ckpt"][name])


def _checked(proc) -> float:
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.rstrip().split(" ep=")[0].endswith("OK"), proc.stdout
    return max_logit_diff(proc)


def _verify(hf, ckpt, tokens: int, tol: float, tp: int = 1, pp: int = 1, ep: int = 1) -> float:
    return _checked(run_cli(*_verify_args(hf, ckpt, tokens, tol, tp, pp, ep)))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(layouts, name):
    assert _checked(layouts["verify"][name]) <= TOL


# the 1100-token prompt checks positions 0..47 too, in the same forward
@slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers_short_prompt(converted, name):
    hf, ckpt = converted(name)
    assert _verify(hf, ckpt, 48, TOL) <= TOL


@slow
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("layout", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["tp2", "pp2", "ep2"])
def test_logits_match_transformers_parallel(converted, name, layout):
    hf, ckpt = converted(name)
    assert _verify(hf, ckpt, 1100, TOL, *layout) <= TOL


@pytest.mark.parametrize("name", list(CONFIGS))
def test_round_trip_bit_exact(converted, name, tmp_path):
    hf, ckpt = converted(name)
    assert main(["--quiet", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "back")]) == 0
    assert assert_same_hf_tensors(hf, tmp_path / "back") > 4 * 9
