"""LoRA adapter tensors as full, canonically named tensors: gathered from the TP/PP shards to rank 0, loaded back
into any layout, and saved as an adapter folder (`adapters.safetensors` + `lora.json`) that names the base model
by path and content hash.

Why full canonical tensors: they are layout-free (a TP=2 run's adapters load into TP=1 or PP=2, an EP=2 run's expert
adapters into EP=1: canonical names carry the global expert index), and they are what the PEFT export
(convert/peft_export.py) splits into HF module names.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

import torch

from mcore_rl import distributed as D
from mcore_rl.config.model import LoraConfig
from mcore_rl.policy.build import unwrap
from mcore_rl.policy.lora import adapted_linears, is_adapter_param, shard_group
from mcore_rl.policy.param_names import copy_shard

ADAPTERS_FILE = "adapters.safetensors"
META_FILE = "lora.json"


def _local_adapters(model) -> Iterator[tuple[str, str, torch.nn.Module, torch.nn.Parameter]]:
    """(canonical name, 'A' | 'B', linear, this rank's shard) for every adapter tensor of this rank."""
    from mcore_rl.policy.param_names import global_name

    gpt = unwrap(model)
    for name, linear in adapted_linears(gpt):
        for which in ("A", "B"):
            yield global_name(gpt, f"{name}.lora_{which}"), which, linear, getattr(linear, f"lora_{which}")


def _is_split(linear, which: str) -> bool:
    return (linear._lora.kind, which) in (("column", "B"), ("row", "A"))


def _cat_parts(name: str, linear, which: str, parts: list[torch.Tensor]) -> torch.Tensor:
    if linear._lora.kind == "row":
        return torch.cat(parts, dim=1)
    if name.endswith("linear_fc1.lora_B"):  # each rank holds [gate_r; up_r] rows, like fc1's weight
        halves = [torch.chunk(p, 2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=0)


def _slice(name: str, linear, which: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    if size == 1 or not _is_split(linear, which):
        return full
    if linear._lora.kind == "row":
        return torch.chunk(full, size, dim=1)[rank]
    if name.endswith("linear_fc1.lora_B"):
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, size, 0)[rank], torch.chunk(up, size, 0)[rank]], dim=0)
    return torch.chunk(full, size, dim=0)[rank]


@torch.no_grad()
def _stage_adapters(model) -> dict[str, torch.Tensor]:
    """This pipeline stage's adapters, full: TP shards gathered over each linear's own group (expert TP for an
    expert), and every EP rank's experts gathered into the stage's ranks (collective within the stage)."""
    from megatron.core import parallel_state as ps

    from mcore_rl.policy.param_names import LOCAL_EXPERT, is_expert, num_local_experts

    mine: dict[str, torch.Tensor] = {}
    for name, which, linear, p in _local_adapters(model):
        t = p.data.to("cpu", torch.float32, copy=True)  # a copy: never an alias of the live parameter
        group = shard_group(linear)
        if group.size() > 1 and _is_split(linear, which):
            t = _cat_parts(name, linear, which, [x.cpu() for x in D.all_gather(p.data.float(), group=group)])
        mine[name] = t
    ep_rank, ep_size = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
    # every EP rank holds the same number of experts, in the same order: gather tensor by tensor
    if ep_size > 1:
        n_local = num_local_experts(unwrap(model))
        for name in [k for k in mine if is_expert(k)]:
            m = LOCAL_EXPERT.match(name)
            j = int(m.group(2)) - ep_rank * n_local
            parts = D.all_gather(mine[name], group=ps.get_expert_model_parallel_group())
            for r, t in enumerate(parts):
                mine[f"{m.group(1)}{r * n_local + j}{m.group(3)}"] = t
    return mine


@torch.no_grad()
def gather_adapters(model) -> dict[str, torch.Tensor] | None:
    """Every adapter tensor, full and canonically named, on global rank 0 (None elsewhere); collective."""
    from megatron.core import parallel_state as ps

    from mcore_rl.policy.weight_stream import stage_src_rank

    mine = _stage_adapters(model)
    rank, out = D.global_rank(), {}
    my_stage = ps.get_pipeline_model_parallel_rank()
    for stage in range(ps.get_pipeline_model_parallel_world_size()):
        src = stage_src_rank(stage)
        if stage == my_stage and rank == src:
            if rank == 0:
                out.update(mine)
            else:
                D.send_object(mine, 0)
        elif rank == 0 and src != 0:
            out.update(D.recv_object(src))
    return out if rank == 0 else None


@torch.no_grad()
def load_adapters(model, get_full: Callable[[str], torch.Tensor]) -> int:
    """Fill this rank's adapter shards from full canonical tensors (any layout wrote them). Returns the count."""
    n = 0
    for name, which, linear, p in _local_adapters(model):
        group = shard_group(linear)
        rank, size = group.rank(), group.size()
        shard = _slice(name, linear, which, get_full(name), rank, size)
        copy_shard(
            p, shard, f"LoRA adapter {name} (tp={size})", "were the adapters made with this model.lora.rank?"
        )
        n += 1
    return n


def load_adapter_entries(model, state: dict) -> None:
    """Loaded adapter tensors into the model; every adapter must be there and nothing else."""
    params = {n: p for n, p in unwrap(model).named_parameters() if is_adapter_param(n)}
    if set(state) != set(params):
        missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
        raise ValueError(
            f"LoRA checkpoint does not match the model's adapters: missing {missing[:3]}, "
            f"unexpected {extra[:3]}"
        )
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(state[n])


def base_model_hash(folder: str | Path) -> str:
    """sha256 over the HF folder's config.json and weight files (names and bytes): the base an adapter is for."""
    h = hashlib.sha256()
    folder = Path(folder)
    for p in sorted(folder.iterdir()):
        if p.name == "config.json" or p.suffix == ".safetensors":
            h.update(p.name.encode())
            with p.open("rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
    return h.hexdigest()


def base_reference(policy) -> dict | None:
    """{base_model, base_sha256} of a LoRA policy's base on global rank 0 (hashed once), None elsewhere or
    without adapters: what a LoRA checkpoint records instead of the base weights."""
    from mcore_rl.policy.lora import has_adapters

    if D.global_rank() != 0 or policy.base_path is None or not has_adapters(policy.model):
        return None
    if getattr(policy, "_base_ref", None) is None:
        policy._base_ref = {
            "base_model": str(policy.base_path.resolve()),
            "base_sha256": base_model_hash(policy.base_path),
        }
    return policy._base_ref


def check_base(policy, recorded: dict | None) -> None:
    """Refuse (on every rank) to resume LoRA adapters onto a base other than the one they were trained on."""
    mine = base_reference(policy)
    err = None
    if recorded and mine and recorded["base_sha256"] != mine["base_sha256"]:
        err = (
            f"LoRA checkpoint was trained on {recorded['base_model']} (sha256 {recorded['base_sha256'][:12]}), "
            f"this run's base {mine['base_model']} hashes to {mine['base_sha256'][:12]}; refusing to resume"
        )
    err = D.broadcast_object(err, 0)
    if err:
        raise ValueError(err)


def save_adapter_folder(
    tensors: dict[str, torch.Tensor], out: str | Path, cfg: LoraConfig, base: str | Path
) -> Path:
    """`adapters.safetensors` (canonical names) + `lora.json` (rank, alpha, targets, base path + hash)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / ADAPTERS_FILE)
    meta = {
        "lora": asdict(cfg),
        "base_model": str(Path(base).resolve()),
        "base_sha256": base_model_hash(base),
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=2))
    return out


def read_adapter_folder(folder: str | Path) -> tuple[dict[str, torch.Tensor], LoraConfig, dict]:
    """(tensors, LoraConfig, meta) of an adapter folder; a clear error when it is not one."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / META_FILE).is_file() or not (folder / ADAPTERS_FILE).is_file():
        raise FileNotFoundError(
            f"{folder} is not a LoRA adapter folder (needs {META_FILE} and {ADAPTERS_FILE})"
        )
    meta = json.loads((folder / META_FILE).read_text())
    return load_file(folder / ADAPTERS_FILE), LoraConfig(**meta["lora"]), meta
