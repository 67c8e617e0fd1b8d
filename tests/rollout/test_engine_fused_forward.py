"""The engine's own decode-step forward (mcore_rl/rollout/local/decode_forward.py): for every family it covers
(llama with default / llama3 / linear RoPE, biases and GELU; qwen2 with biases; qwen3 with q/k norms and YaRN;
mistral without a window) the engine's log-probs equal a plain transformers forward within 1e-4 (fp32) and the
HF-forward engine's tokens; what it does not cover (sliding windows) runs the HF forward; weight updates reach
the fused weights, also after the parameters were re-pointed at new storage."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.rollout.local.decode_forward import SKINNY_ROWS, linear, unsupported
from mcore_rl.rollout.local.engine import LocalEngine
from mcore_rl.rollout.protocol import GenerationRequest, SamplingParams
from tests.conftest import save_random_hf
from tests.rollout.conftest import forward_logprobs

pytestmark = pytest.mark.rollout
PROMPTS = [[5, 17, 33, 8, 90, 4, 61], [7, 8, 9], [200, 3, 44, 12, 5]]
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-5,
             tie_word_embeddings=False)  # fmt: skip
COVERED = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama", dict(rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                       high_freq_factor=4.0, original_max_position_embeddings=16,
                                                       rope_theta=10000.0))),
    "linear-rope": ("llama", dict(rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=10000.0))),
    "llama-bias-gelu": ("llama", dict(attention_bias=True, mlp_bias=True, hidden_act="gelu_pytorch_tanh")),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-yarn-qknorm": ("qwen3", dict(head_dim=32, rope_parameters=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=16, rope_theta=10000.0))),
    "mistral-no-window": ("mistral", dict(head_dim=16, sliding_window=None)),
}  # fmt: skip
WINDOWED = {
    "mistral-window": ("mistral", dict(head_dim=16, sliding_window=8)),
    "qwen2-window": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
}


def _folder(tmp_path, model_type: str, fields: dict):
    from transformers import AutoConfig

    return save_random_hf(tmp_path, AutoConfig.for_model(model_type, **{**SHAPE, **fields}), seed=0)


def _generate(eng: LocalEngine, seed: int = 5, tokens: int = 24) -> list:
    sp = dict(temperature=1.0, max_new_tokens=tokens, ignore_eos=True)
    reqs = [GenerationRequest(p, SamplingParams(n=2, seed=seed + i, **sp)) for i, p in enumerate(PROMPTS)]
    return eng.generate(reqs)


def _max_logprob_diff(model, samples) -> float:
    prompts = [p for p in PROMPTS for _ in range(2)]
    return max(
        (torch.tensor(s.output_logprobs) - forward_logprobs(model, p, s.output_ids, 1.0)).abs().max().item()
        for p, s in zip(prompts, samples)
    )


# the fused forward runs these through the same code as the default-suite cases (the model's own rotary module)
SLOW = {"llama3-rope", "linear-rope", "mistral-no-window", "qwen2-window"}


def _params(names):
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in names]


@pytest.mark.parametrize("layout", ["out", "in"])
@pytest.mark.parametrize("name", _params(COVERED))
def test_fused_forward_equals_transformers(name, layout, tmp_path):
    """Both weight layouts (weight_layout.py): [in, out] buffers behind transposed HF views compute the same
    log-probs, and the HF reference forward runs on those views too."""
    folder = _folder(tmp_path, *COVERED[name])
    with LocalEngine(str(folder), weight_layout=layout) as eng:
        assert unsupported(eng.model) is None and eng._batch.fused is not None
        assert all(f.in_major == (layout == "in") for f in eng._batch.fused.layers)
        fused = _generate(eng)
        diff = _max_logprob_diff(eng.model, fused)
        assert not eng.set_fast_decode(forward=False)  # the reference: transformers' own decode forward
        plain = _generate(eng)
    assert diff < 1e-4, diff
    assert [s.output_ids for s in fused] == [s.output_ids for s in plain]
    lp = torch.tensor([s.output_logprobs for s in fused]) - torch.tensor([s.output_logprobs for s in plain])
    assert lp.abs().max().item() < 1e-4


@pytest.mark.parametrize("name", _params(WINDOWED))
def test_sliding_windows_run_the_hf_forward(name, tmp_path):
    folder = _folder(tmp_path, *WINDOWED[name])
    with LocalEngine(str(folder)) as eng:
        assert "sliding" in unsupported(eng.model)
        assert not eng.set_fast_decode(forward=True) and eng._batch.fused is None
        assert _max_logprob_diff(eng.model, _generate(eng)) < 1e-4


def test_deterministic_with_the_fused_forward(tiny_dir):
    with LocalEngine(str(tiny_dir)) as eng:
        a, b = _generate(eng, seed=9), _generate(eng, seed=9)
    assert [s.output_ids for s in a] == [s.output_ids for s in b]
    assert [s.output_logprobs for s in a] == [s.output_logprobs for s in b]


@pytest.mark.parametrize("layout", ["out", "in"])
@pytest.mark.parametrize("repoint", [False, True])
def test_weight_update_reaches_the_fused_weights(tiny_dir, tiny_alt_model, repoint, layout):
    """update_weights copies in place into the fused q/k/v, gate/up, o and down buffers (in the [in, out] layout
    through the parameters' transposed views); parameters re-pointed at new storage (what `module.to()` does) are
    re-fused by the update. Either way the next tokens' log-probs are the new model's."""
    with LocalEngine(str(tiny_dir), weight_layout=layout) as eng:
        fused = eng._batch.fused
        attn = eng.model.model.layers[0].self_attn
        q, o = attn.q_proj.weight, attn.o_proj.weight
        if repoint:
            for p in eng.model.parameters():
                p.data = p.data.clone()
            assert not fused.layers[0].is_fused()
        eng.update_weights(tiny_alt_model.state_dict().items(), version=1)
        assert all(f.is_fused() for f in fused.layers)
        assert q.data_ptr() == fused.layers[0].qkv.data_ptr() and o.data_ptr() == fused.layers[0].o.data_ptr()
        new_attn = tiny_alt_model.model.layers[0].self_attn
        qkv = fused.layers[0].qkv.t() if layout == "in" else fused.layers[0].qkv
        assert torch.equal(qkv[: q.shape[0]], new_attn.q_proj.weight)
        o_w = fused.layers[0].o.t() if layout == "in" else fused.layers[0].o
        assert torch.equal(o_w, new_attn.o_proj.weight)
        samples = _generate(eng)
    assert _max_logprob_diff(tiny_alt_model, samples) < 1e-4


def test_layout_switch_between_generations_keeps_the_samples(tiny_dir):
    """set_weight_layout re-stores the weights between steps: the same seeds give the same tokens and log-probs
    within float rounding, and switching back restores PyTorch's [out, in] parameters."""
    with LocalEngine(str(tiny_dir), weight_layout="out") as eng:
        before = _generate(eng, seed=3)
        eng.set_weight_layout("in")
        q = eng.model.model.layers[0].self_attn.q_proj.weight
        qkv_t = eng._batch.fused.layers[0].qkv  # [hidden, q + k + v outputs]
        assert eng.weight_layout.in_major and qkv_t.is_contiguous() and qkv_t.shape[0] == q.shape[1]
        assert q.data_ptr() == qkv_t.data_ptr() and q.stride() == (1, qkv_t.shape[1])
        after = _generate(eng, seed=3)
        eng.set_weight_layout("out")
        assert eng.model.model.layers[0].self_attn.q_proj.weight.is_contiguous()
        again = _generate(eng, seed=3)
    assert [s.output_ids for s in before] == [s.output_ids for s in after] == [s.output_ids for s in again]
    lp = torch.tensor([s.output_logprobs for s in before]) - torch.tensor([s.output_logprobs for s in after])
    assert lp.abs().max().item() < 1e-5


@pytest.mark.parametrize("rows", list(range(1, SKINNY_ROWS + 2)))
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_equals_the_plain_product(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(300, 96, generator=gen), torch.randn(rows, 96, generator=gen)
    b = torch.randn(300, generator=gen) if bias else None
    got = linear(x, weight, b)
    assert got.shape == (rows, 300) and got.is_contiguous()
    assert (got - torch.nn.functional.linear(x, weight, b)).abs().max().item() < 1e-4


class _Calls(torch.overrides.TorchFunctionMode):
    """Records the torch functions called inside it (which GEMM form a dispatch picked)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rows", [1, 2, SKINNY_ROWS])
def test_skinny_rows_regroup_in_fp32_only(rows):
    """fp32: weight @ x^T (torch.mm); bf16, whose GEMM is faster on skinny rows as x @ W^T itself: F.linear."""
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(300, 96, generator=gen), torch.randn(rows, 96, generator=gen)
    for dtype, form in ((torch.float32, "mm"), (torch.bfloat16, "linear")):
        with _Calls() as calls:
            linear(x.to(dtype), weight.to(dtype), None)
        assert form in calls.names and ({"mm", "linear"} - {form}).isdisjoint(calls.names), (dtype, calls.names)


def test_lm_head_form_follows_the_weight_layout(tiny_dir):
    """The LM head regroups its CPU products (lm_head.py) with [out, in] layer weights and runs the plain product
    with [in, out] (where `auto` found the plain skinny GEMMs faster); the logits agree to float rounding."""
    with LocalEngine(str(tiny_dir), weight_layout="out") as eng:
        hidden = torch.randn(3, eng.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        head = eng._batch.last_logits
        forms = {}
        for layout in ("out", "in"):
            eng.set_weight_layout(layout)
            with _Calls() as calls:
                logits = head.of(hidden)
            forms[layout] = (calls.names, logits)
    assert "mm" in forms["out"][0] and "linear" not in forms["out"][0]  # weight @ hidden^T, regrouped
    assert "linear" in forms["in"][0] and "mm" not in forms["in"][0]
    assert (forms["out"][1] - forms["in"][1]).abs().max().item() < 1e-5
