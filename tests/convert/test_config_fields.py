"""Adapters map HF config fields exactly or refuse them: real config objects from transformers' config classes are
walked through each family's declaration; unknown or unimplemented math-changing fields give one-line refusals at
conversion (CLI exit 2)."""

from __future__ import annotations

import pytest

from mcore_rl.convert.cli import main
from mcore_rl.models.base import family_for
from mcore_rl.models.fields import UnsupportedConfigError
from tests.convert.conftest import qwen3_config, qwen3_moe_config, save_random_model

pytestmark = pytest.mark.convert


def _configs():
    from transformers import (
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    return {"LlamaForCausalLM": LlamaConfig(), "Qwen2ForCausalLM": Qwen2Config(), "Qwen3ForCausalLM": Qwen3Config(),
            "Qwen3MoeForCausalLM": Qwen3MoeConfig(), "MistralForCausalLM": MistralConfig(),
            "Qwen2MoeForCausalLM": Qwen2MoeConfig()}


def _as_dict(arch: str, config) -> dict:
    d = config.to_dict()
    d["architectures"] = [arch]
    return d


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                                  "MistralForCausalLM", "Qwen2MoeForCausalLM"])
def test_every_field_of_a_real_config_is_declared(arch):
    cfg = _as_dict(arch, _configs()[arch])
    family = family_for(cfg)
    args = family.args(cfg)  # no refusal: every field is declared and at a supported value
    declared = family.fields()
    undeclared = [k for k in cfg if k not in declared and not k.startswith("_") and not k.endswith("_token_id")]
    assert undeclared == []
    assert args.num_layers == cfg["num_hidden_layers"] and args.vocab_size == cfg["vocab_size"]
    assert (args.moe is not None) == arch.endswith("MoeForCausalLM")
    if arch == "Qwen3MoeForCausalLM":
        assert (args.moe.num_experts, args.moe.topk) == (128, 8)
    if arch == "Qwen2MoeForCausalLM":
        assert (args.moe.num_experts, args.moe.topk, args.moe.shared_expert_size) == (60, 4, 5632)
        assert args.moe.shared_expert_gate and args.qkv_bias


REFUSED = [  # (architecture, field, value, words in the one-line message)
    ("LlamaForCausalLM", "attention_bias", True, "o_proj"),
    ("LlamaForCausalLM", "mlp_bias", True, "must be equal"),
    ("LlamaForCausalLM", "hidden_act", "gelu_fast", "gelu_pytorch_tanh"),
    ("Qwen2ForCausalLM", "attention_bias", True, "only False"),
    ("LlamaForCausalLM", "rope_parameters", {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}, "dynamic"),
    ("LlamaForCausalLM", "rope_parameters", {"rope_type": "longrope", "short_factor": [1.0], "rope_theta": 1e4},
     "longrope"),
    ("LlamaForCausalLM", "rope_parameters", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                                             "rope_theta": 5e5}, "high_freq_factor"),
    ("LlamaForCausalLM", "rope_parameters", {"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5,
                                             "rope_theta": 1e4}, "partial_rotary_factor"),
    ("MistralForCausalLM", "sliding_window", 0, "positive"),
    ("Qwen3MoeForCausalLM", "use_sliding_window", True, "only False"),  # MoE layers: Megatron's local attention
    ("Qwen2ForCausalLM", "max_window_layers", -1, "non-negative"),
    ("Qwen3ForCausalLM", "layer_types", ["chunked_attention"] * 4, "not implemented"),
    ("Qwen3ForCausalLM", "attn_logit_softcapping", 30.0, "unknown"),
    ("Qwen3MoeForCausalLM", "decoder_sparse_step", 0, "positive integer"),
    ("Qwen3MoeForCausalLM", "mlp_only_layers", [0, 99], "[99] are not layers"),
    ("Qwen3MoeForCausalLM", "quantization_config", {"quant_method": "fp8"}, "unknown"),
]


@pytest.mark.parametrize("arch,field,value,words", REFUSED, ids=[f"{a[:6]}-{f}" for a, f, _, _ in REFUSED])
def test_math_changing_field_is_refused_in_one_line(arch, field, value, words):
    cfg = _as_dict(arch, _configs()[arch])
    cfg[field] = value
    with pytest.raises(UnsupportedConfigError) as e:
        family_for(cfg).args(cfg)
    msg = str(e.value)
    assert "\n" not in msg and f"{field}=" in msg and arch in msg and words in msg


def test_harmless_fields_pass():
    cfg = _as_dict("Qwen3MoeForCausalLM", _configs()["Qwen3MoeForCausalLM"])
    cfg.update(router_aux_loss_coef=0.5, initializer_range=0.5, use_cache=False, unk_token_id=0, _name_or_path="x")
    assert family_for(cfg).args(cfg).moe.norm_topk_prob is False


@pytest.mark.parametrize("make,field,value", [
    (qwen3_config, "attn_logit_softcapping", 50.0),
    (qwen3_moe_config, "decoder_sparse_step", 0),
])
def test_conversion_refuses_with_one_line(tmp_path, capsys, make, field, value):
    hf = save_random_model(tmp_path / "hf", make())
    import json

    cfg = json.loads((hf / "config.json").read_text())
    cfg[field] = value
    (hf / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()  # drop transformers' save progress bar
    assert main(["--quiet", "hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and f"{field}={value}" in err[0], err
    assert not (tmp_path / "ckpt").exists()
