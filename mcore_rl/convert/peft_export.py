"""LoRA adapter folder (policy/lora_state.py: full canonical Megatron adapters) -> a PEFT adapter folder that
`peft.PeftModel.from_pretrained` loads onto the HF base, or -> a merged HF folder (base + alpha/r * B @ A).

Fused modules: Megatron's linear_qkv (rows [q; k; v] per query group) and linear_fc1 (rows [gate; up]) each have
ONE adapter, delta = s * B @ A with B's rows laid out like the weight's. Splitting B's rows exactly as the family
adapter splits the weight gives B_q, B_k, B_v (B_gate, B_up), and s * B_q @ A is precisely the q rows of the delta:
so every HF module gets its slice of B and the SAME A, each module a rank-r PEFT adapter with the run's alpha.
linear_proj / linear_fc2 map 1:1 (o_proj, down_proj). Nothing is approximated; the rank does not grow.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from mcore_rl.convert.common import ConvertError, staged_output
from mcore_rl.models.base import ModelArgs, ModelFamily, family_for, read_hf_config
from mcore_rl.models.hf_io import HFReader, copy_side_files, write_hf_shards

PEFT_PREFIX = "base_model.model."
SUFFIXES = (".lora_A", ".lora_B")
# MoE families whose per-expert PEFT adapters peft loads exactly onto transformers' fused expert stacks (checked:
# tests/lora/test_lora_moe_cli.py). peft's v4 -> v5 MoE conversion retargets every bare gate_proj/up_proj/down_proj
# to the fused experts, so a shared expert's adapters cannot be named; other families are unverified.
PEFT_EXPERT_FAMILIES = ("Qwen3MoeForCausalLM",)


def _linears(adapters: dict[str, torch.Tensor]) -> list[str]:
    """Canonical linear names ('decoder.layers.0.self_attention.linear_qkv') that carry an adapter."""
    names = sorted({n.removesuffix(s) for n in adapters for s in SUFFIXES if n.endswith(s)})
    for lin in names:
        for s in SUFFIXES:
            if lin + s not in adapters:
                raise ConvertError(
                    f"adapter {lin}{s} is missing (the folder has only one half of that adapter)"
                )
    return names


def hf_module_adapters(
    adapters: dict[str, torch.Tensor], family: ModelFamily, args: ModelArgs
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(HF module name, A [r, in], B [out_module, r]) per HF linear, the fused ones split (see module doc)."""
    for lin in _linears(adapters):
        a, b = adapters[lin + ".lora_A"], adapters[lin + ".lora_B"]
        for hf_name, b_part in family.to_hf(args, lin + ".weight", b):
            yield hf_name.removesuffix(".weight"), a, b_part


def _read(adapter_dir: str | Path):
    from mcore_rl.config.checks import ConfigError
    from mcore_rl.policy.lora_state import read_adapter_folder

    try:
        return read_adapter_folder(adapter_dir)
    except (FileNotFoundError, KeyError, TypeError, ConfigError) as e:
        raise ConvertError(f"--adapters {adapter_dir}: {e}") from None


def _model(base: str | Path) -> tuple[ModelFamily, ModelArgs]:
    hf = read_hf_config(base)
    family = family_for(hf)
    return family, family.args(hf)


def _check_peft_experts(adapters: dict[str, torch.Tensor], args: ModelArgs) -> None:
    moe = [n for n in adapters if ".mlp.experts." in n or ".mlp.shared_experts." in n]
    shared = any(".shared_experts." in n for n in moe)
    if moe and (shared or args.architecture not in PEFT_EXPERT_FAMILIES):
        raise ConvertError(
            f"lora-to-peft: expert adapters of {args.architecture}{' (shared expert)' if shared else ''} have no "
            f"PEFT form that peft loads exactly (supported: {', '.join(PEFT_EXPERT_FAMILIES)}); "
            "use lora-merge for a merged HF folder"
        )


def export_peft(
    adapter_dir: str | Path, out: str | Path, base: str | Path | None = None, force: bool = False
) -> Path:
    """Write `adapter_config.json` + `adapter_model.safetensors` (PEFT's LoRA format) into `out`."""
    from safetensors.torch import save_file

    adapters, cfg, meta = _read(adapter_dir)
    base = base or meta["base_model"]
    family, args = _model(base)
    _check_peft_experts(adapters, args)
    tensors, modules = {}, set()
    for module, a, b in hf_module_adapters(adapters, family, args):
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.contiguous().clone()
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b.contiguous().clone()
        modules.add(module.rsplit(".", 1)[-1])
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }
    with staged_output(out, force) as stage:
        stage.mkdir(parents=True)
        save_file(tensors, stage / "adapter_model.safetensors", metadata={"format": "pt"})
        (stage / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return Path(out)


def merged_tensors(
    adapters: dict[str, torch.Tensor], scale: float, family: ModelFamily, args: ModelArgs, reader: HFReader
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every base tensor, with W + scale * B @ A on the adapted modules (in fp32, cast back to W's dtype)."""
    deltas = {f"{m}.weight": (a, b) for m, a, b in hf_module_adapters(adapters, family, args)}
    for name in reader.names():
        w = reader.get(name)
        if name in deltas:
            a, b = deltas.pop(name)
            w = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
        yield name, w
    if deltas:
        raise ConvertError(f"the base model has no tensor {next(iter(deltas))} for its adapter; wrong base?")


def export_merged(
    adapter_dir: str | Path,
    out: str | Path,
    base: str | Path | None = None,
    force: bool = False,
    max_shard_bytes: int = 2 << 30,
) -> Path:
    """An HF folder of the adapted model (base side files copied), loadable without peft."""
    adapters, cfg, meta = _read(adapter_dir)
    base = base or meta["base_model"]
    family, args = _model(base)
    with HFReader(base) as reader, staged_output(out, force) as stage:
        stage.mkdir(parents=True)
        write_hf_shards(
            merged_tensors(adapters, cfg.alpha / cfg.rank, family, args, reader), stage, max_shard_bytes
        )
        copy_side_files(base, stage)
    return Path(out)
