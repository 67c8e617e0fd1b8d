"""Dataset registry: `build_dataset(cfg)` turns a Hydra `data` group entry into a PromptDataset by `kind`."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from mcore_rl.data.champ import ChampConfig, load_champ
from mcore_rl.data.generators import ArithmeticConfig, ReasoningGymConfig, make_arithmetic, make_reasoning_gym
from mcore_rl.data.hf import HFDataConfig, load_hf
from mcore_rl.data.records import LoadSummary, PromptRecord, config_from_dict


class PromptDataset:
    """An in-memory, indexable list of PromptRecords plus the summary of how it was loaded."""

    def __init__(self, name: str, records: list[PromptRecord], summary: LoadSummary):
        self.name, self.records, self.summary = name, records, summary
        self._index = {r.prompt_id: i for i, r in enumerate(records)}
        if len(self._index) != len(records):
            raise ValueError(f"dataset {name}: prompt_ids are not unique")

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> PromptRecord:
        return self.records[i]

    def __iter__(self) -> Iterator[PromptRecord]:
        return iter(self.records)

    def by_id(self, prompt_id: str) -> PromptRecord:
        return self.records[self._index[prompt_id]]


@dataclass
class _Kind:
    config: type
    load: Callable[[Any], tuple[list[PromptRecord], LoadSummary]]


DATASETS: dict[str, _Kind] = {}


def register_dataset(kind: str, config: type, load: Callable[[Any], tuple[list[PromptRecord], LoadSummary]]) -> None:
    if kind in DATASETS:
        raise ValueError(f"dataset kind {kind!r} registered twice")
    DATASETS[kind] = _Kind(config, load)


register_dataset("hf", HFDataConfig, load_hf)
register_dataset("arithmetic", ArithmeticConfig, make_arithmetic)
register_dataset("reasoning_gym", ReasoningGymConfig, make_reasoning_gym)
register_dataset("champ", ChampConfig, load_champ)

# Keys of a data yaml that belong to the sampler, not to the dataset builder.
SAMPLER_KEYS = ("sampler",)


def plain(cfg: Any) -> dict[str, Any]:
    if cfg is None:
        return {}
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    return dict(cfg)


def build_dataset(cfg: Mapping[str, Any] | Any) -> PromptDataset:
    """From `{kind: hf|arithmetic|reasoning_gym|champ, ...options}` (a Hydra `data` yaml)."""
    options = plain(cfg)
    kind = options.pop("kind", None)
    if kind not in DATASETS:
        raise ValueError(f"data.kind={kind!r} unknown; registered: {sorted(DATASETS)}")
    for key in SAMPLER_KEYS:
        options.pop(key, None)
    entry = DATASETS[kind]
    records, summary = entry.load(config_from_dict(entry.config, options, f"data ({kind})"))
    return PromptDataset(summary.source, records, summary)
