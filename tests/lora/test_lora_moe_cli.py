"""`mcore-rl-train model=tiny_moe` with adapters on attention and every expert's fc1/fc2: real gradient steps that
move only the adapters (the merged export is exactly base + s * B @ A, every other tensor bit-equal to the base), and
the adapter folder exported to PEFT (per-expert HF names, loaded by the real peft onto transformers' fused
Qwen3-MoE experts) and merged by `lora-merge` both reproduce the trained model's logits."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_train_batch
from tests.e2e.test_train_moe import FAST

pytestmark = pytest.mark.e2e
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "optim.lr=1e-2",
        "model.lora.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]"]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_moe_cli")
    (res,) = run_train_batch([[*FAST, *LORA, f"run.dir={root / 'run'}"]], root)
    assert res.returncode == 0, res.stderr[-4000:]
    return root / "run", res


def test_steps_train_adapters_only(trained):
    from mcore_rl.convert.peft_export import _model, hf_module_adapters
    from mcore_rl.models.hf_io import HFReader
    from mcore_rl.policy.lora_state import read_adapter_folder

    run_dir, _ = trained
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in recs] == [1, 2]
    assert all(r["grad_norm"] > 1e-6 and r["loss"] != 0 for r in recs)  # B starts at 0: only B has grad
    assert recs[1]["train_rollout_logprob_abs_diff"] < 1e-5  # the engine sampled step 2 with merged experts
    adapters, cfg, meta = read_adapter_folder(run_dir / "lora")
    # model=tiny_moe: 2 layers x 8 experts x (fc1, fc2) x (A, B)
    assert sum(".experts.local_experts." in n for n in adapters) == 2 * 8 * 2 * 2
    family, args = _model(meta["base_model"])
    deltas = {f"{m}.weight": (a, b) for m, a, b in hf_module_adapters(adapters, family, args)}
    assert sum(".mlp.experts." in n for n in deltas) == 2 * 8 * 3  # gate/up/down per expert
    moved = 0
    with HFReader(meta["base_model"]) as base, HFReader(run_dir / "hf") as merged:
        assert sorted(base.names()) == sorted(merged.names())
        for name in base.names():
            w, m = base.get(name), merged.get(name)
            if name not in deltas:
                assert torch.equal(w, m), name  # frozen base: bitwise unchanged
                continue
            a, b = deltas[name]
            assert (m - (w + cfg.alpha / cfg.rank * b @ a)).abs().max().item() < 1e-5, name
            moved += int((m - w).abs().max().item() > 1e-4)
    assert moved == len(deltas)  # every adapted module (experts included) moved off the base


# peft checks its gate_up_proj rank/alpha patterns against the wrapper's inner name and warns, yet applies them
# (the loaded expert adapters have rank 2R, asserted below)
@pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys did not match:RuntimeWarning")
def test_peft_and_merge_exports_reproduce_the_trained_model(trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mcore_rl.convert.cli import main
    from mcore_rl.policy.lora_state import read_adapter_folder

    run_dir, _ = trained
    for cmd in ("lora-to-peft", "lora-merge"):
        assert main(["--quiet", cmd, "--adapters", str(run_dir / "lora"), "--out", str(tmp_path / cmd)]) == 0
    peft_cfg = json.loads((tmp_path / "lora-to-peft" / "adapter_config.json").read_text())
    assert set(peft_cfg["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"}  # fmt: skip
    base = read_adapter_folder(run_dir / "lora")[2]["base_model"]
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))

    def logits(folder) -> torch.Tensor:
        with torch.no_grad():
            return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(tokens).logits

    plain, merged, merged_cli = logits(base), logits(run_dir / "hf"), logits(tmp_path / "lora-merge")
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        peft_model = PeftModel.from_pretrained(model, tmp_path / "lora-to-peft").eval()
        peft_logits = peft_model(tokens).logits
    # peft folds the per-expert gate/up/down adapters into its wrappers of the fused expert stacks (rank 2r for
    # gate_up_proj: [gate; up] is one block-diagonal adapter): the expert B's arrived, non-zero
    expert_b = [t for n, t in peft_model.named_parameters() if ".mlp.experts." in n and ".lora_B." in n]
    assert len(expert_b) == 2 * 2 and all(t.abs().max().item() > 1e-3 for t in expert_b)
    rank = {n.split(".mlp.experts.")[1].split(".")[0]: t.shape[1] // 8 for n, t in peft_model.named_parameters()
            if ".layers.0.mlp.experts." in n and ".lora_B." in n}  # fmt: skip
    assert rank == {"base_layer": 8, "lora_B": 4}  # gate_up_proj (inner wrapper): 2R per expert; down_proj: R
    assert (merged - plain).abs().max().item() > 1e-3  # training moved the adapters
    assert (merged_cli - merged).abs().max().item() < 1e-4
    assert (peft_logits - merged).abs().max().item() < 1e-4


def test_qwen2_moe_expert_adapters_merge_but_peft_export_is_refused(tmp_path, capsys):
    """Qwen2-MoE's shared expert: peft's MoE conversion retargets every bare gate_proj/up_proj to the fused
    experts, so no PEFT folder loads these adapters exactly; lora-to-peft refuses in one line, lora-merge works."""
    from transformers import Qwen2MoeConfig

    from mcore_rl.config.model import LoraConfig
    from mcore_rl.convert.cli import main
    from mcore_rl.models.hf_io import HFReader
    from mcore_rl.policy.lora_state import save_adapter_folder
    from tests.convert.conftest import save_random_model

    cfg = Qwen2MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=1,
                         shared_expert_intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                         num_experts=4, num_experts_per_tok=2, vocab_size=512)  # fmt: skip
    hf = save_random_model(tmp_path / "hf", cfg)
    g = torch.Generator().manual_seed(0)
    p = "decoder.layers.0.mlp."
    shapes = {f"{p}experts.local_experts.2.linear_fc1": (64, 64), f"{p}shared_experts.linear_fc2": (48, 64)}
    tensors = {}
    for lin, (inp, out) in shapes.items():
        tensors[lin + ".lora_A"] = torch.randn(4, inp, generator=g)
        tensors[lin + ".lora_B"] = torch.randn(out, 4, generator=g)
    save_adapter_folder(tensors, tmp_path / "lora", LoraConfig(rank=4, alpha=8.0), hf)
    args = ["--adapters", str(tmp_path / "lora"), "--out"]
    capsys.readouterr()  # the base model's save progress bar
    assert main(["--quiet", "lora-to-peft", *args, str(tmp_path / "peft")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: lora-to-peft: expert adapters of Qwen2MoeForCausalLM (shared expert)")
    assert len(err.splitlines()) == 1 and not (tmp_path / "peft").exists()
    assert main(["--quiet", "lora-merge", *args, str(tmp_path / "merged")]) == 0
    a, b = (
        tensors[f"{p}experts.local_experts.2.linear_fc1.lora_A"],
        tensors[f"{p}experts.local_experts.2.linear_fc1.lora_B"],
    )
    with HFReader(hf) as base, HFReader(tmp_path / "merged") as merged:
        for i, proj in enumerate(("gate_proj", "up_proj")):  # fc1's B rows: [gate; up]
            name = f"model.layers.0.mlp.experts.2.{proj}.weight"
            want = base.get(name) + 2.0 * b[32 * i : 32 * (i + 1)] @ a
            assert (merged.get(name) - want).abs().max().item() < 1e-5
        name = "model.layers.0.mlp.shared_expert.down_proj.weight"
        delta = (
            2.0
            * tensors[f"{p}shared_experts.linear_fc2.lora_B"]
            @ tensors[f"{p}shared_experts.linear_fc2.lora_A"]
        )
        assert (merged.get(name) - (base.get(name) + delta)).abs().max().item() < 1e-5
