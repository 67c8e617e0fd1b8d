"""The Megatron reward model (policy/score_model.py) scores token rows as transformers' sequence classifier does.

The test RM (tests/rewards/rm_fixture.py: SmolLM2's 30 layers under a seeded one-logit head) in fp32 at TP=1, in this
process; TP=2 and PP=2 run in tests/multiproc/test_score_model_parallel.py. The HF reference is one right-padded batch
with its attention mask, so the scored token is HF's own choice per row (last non-pad token, pad tokens inside a row
included).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.multiproc.score_rm import hf_padded_scores, make_tiny_rm, sample_rows
from tests.rewards.rm_fixture import make_smollm2_rm


@pytest.fixture(scope="module")
def test_rm(tmp_path_factory, smollm2_dir) -> Path:
    return make_smollm2_rm(tmp_path_factory.mktemp("rm"))


def _chat_rows(folder: Path) -> list[list[int]]:
    """Two rendered conversations, as the rm reward renders them (the RM's chat template, no generation prompt)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    out = []
    for q, a in (("What is 2 + 3?", "5"), ("Name a colour.", "Blue, like the sky on a clear summer day.")):
        msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        out.append(
            tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=False, return_dict=False)
        )
    return [list(r) for r in out]


def test_tp1_scores_equal_hf(test_rm, caplog):
    from mcore_rl.distributed import init_distributed
    from mcore_rl.models.spec import BuildConfig
    from mcore_rl.policy.score_model import ScoreModel

    pad = json.loads((test_rm / "config.json").read_text())["pad_token_id"]
    rows = _chat_rows(test_rm) + sample_rows(49152, pad)
    init_distributed(1, 1)
    with caplog.at_level("WARNING", logger="mcore_rl"):
        model = ScoreModel(test_rm, BuildConfig(dtype="fp32"), token_budget=64)  # several micro-batches
    assert any("134.5M parameters" in r.message and "MiB" in r.message for r in caplog.records)
    ref = hf_padded_scores(test_rm, rows, pad)[:, 0]
    got = torch.tensor(model.score_ids(rows))
    assert got.shape == ref.shape and ref.abs().max() > 0.1  # real scores, not all ~0
    assert (got - ref).abs().max().item() < 1e-5
    # order kept: scoring a permutation permutes the scores
    perm = [3, 0, 5, 1, 7, 2, 6, 4]
    again = torch.tensor(model.score_ids([rows[i] for i in perm]))
    assert (again - got[perm]).abs().max().item() < 1e-6


@pytest.mark.parametrize(("arch", "packed"), [("qwen2", False), ("qwen3", True), ("qwen3_moe", False)])
def test_tiny_qwen_rms_equal_hf(arch, packed, tmp_path):
    """The other families' classifiers (Qwen2's q/k/v biases, Qwen3's QK norms, Qwen3-MoE's routed experts), a
    label column other than 0, and micro-batches packed without pad tokens (policy/packing.py; on CUDA)."""
    from mcore_rl.distributed import init_distributed
    from mcore_rl.models.spec import BuildConfig
    from mcore_rl.policy.score_model import ScoreModel

    folder = make_tiny_rm(tmp_path / arch, architecture=arch)
    rows = sample_rows(512, 0)
    init_distributed(1, 1)
    model = ScoreModel(folder, BuildConfig(dtype="fp32"), token_budget=48, label=1, packed=packed)
    ref = hf_padded_scores(folder, rows, 0)
    assert (model.scores(rows) - ref).abs().max().item() < 1e-5
    assert torch.equal(torch.tensor(model.score_ids(rows)), model.scores(rows)[:, 1])


@pytest.mark.parametrize("arch", ["Qwen2ForRewardModel", "LlamaForCausalLM", "GPT2ForSequenceClassification"])
def test_unsupported_architecture_refused_in_one_line(arch, tmp_path):
    from mcore_rl.models.spec import BuildConfig
    from mcore_rl.policy.score_model import ScoreModel

    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": "x"}))
    with pytest.raises(ValueError) as e:
        ScoreModel(tmp_path, BuildConfig())
    msg = str(e.value)
    assert "\n" not in msg and arch in msg and "reward.rm.path" in msg
    assert "LlamaForSequenceClassification" in msg  # names what is supported


def test_label_out_of_range_refused(tmp_path):
    from mcore_rl.models.spec import BuildConfig
    from mcore_rl.policy.score_model import ScoreModel

    folder = make_tiny_rm(tmp_path / "rm", num_labels=2)
    with pytest.raises(ValueError, match=r"reward.rm.label=2: .* num_labels=2"):
        ScoreModel(folder, BuildConfig(), label=2)
