"""Dataset registry: `build_dataset(cfg)` turns a Hydra `data` group entry into a PromptDataset by `kind`."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from mcore_rl.data.records import LoadSummary, PromptRecord, config_from_dict
from mcore_rl.registry import Registry


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


Loader = Callable[[Any], tuple[list[PromptRecord], LoadSummary]]


@dataclass(frozen=True)
class DataKind:
    """One `data.kind`: its options dataclass (checked key by key) and the loader that takes it."""

    config: type
    load: Loader


DATASETS: Registry[DataKind] = Registry("data.kind", {
    "hf": "mcore_rl.data.hf", "arithmetic": "mcore_rl.data.generators",
    "reasoning_gym": "mcore_rl.data.generators", "champ": "mcore_rl.data.champ",
})  # fmt: skip


def register_dataset(kind: str, config: type) -> Callable[[Loader], Loader]:
    """Decorator on a loader `load(config) -> (records, summary)`: make it `data.kind=<kind>`."""

    def deco(load: Loader) -> Loader:
        DATASETS.add(kind, DataKind(config, load))
        return load

    return deco


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
    for key in SAMPLER_KEYS:
        options.pop(key, None)
    entry = DATASETS.get(kind)
    records, summary = entry.load(config_from_dict(entry.config, options, f"data ({kind})"))
    return PromptDataset(summary.source, records, summary)
