"""`mcore-rl-sft`'s typed config: the root schema `hydra_conf/sft.yaml` composes on, and the `sft.*` keys.

Why a root of its own instead of more keys on the RL root: SFT has no rollout, reward, algorithm or environment,
and an SFT run that accepted `rollout.*` keys would accept them silently. The groups SFT shares with RL (`model`,
`parallel`, `logging`, `optim`, `run`, `seed`) are the same dataclasses, so a key means the same in both.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mcore_rl.config import ConfigError, LoggingConfig, ModelConfig, OptimSettings, ParallelConfig, RunConfig
from mcore_rl.config.checks import one_of, positive

SFT_SCHEMA = "mcore_rl_sft_schema"


@dataclass
class SftDataConfig:
    # jsonl / json / parquet file(s) (a path, folder, glob or list of them): `messages` or prompt/response rows
    path: Any = ""
    heldout_path: Any = None  # held-out rows, the same forms; null: a seeded fraction of `path`'s rows
    heldout_fraction: float = 0.1  # used without heldout_path
    # a chat template replacing the tokenizer's own: a .jinja file, or the Jinja text itself (null: the tokenizer's)
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ConfigError(f"sft.data.heldout_fraction={self.heldout_fraction} must be in [0, 1)")


@dataclass
class SftConfig:
    data: SftDataConfig = field(default_factory=SftDataConfig)
    max_length: int = 2048  # tokens per conversation; longer rows are counted and skipped
    epochs: int = 1  # passes over the train rows (ignored when `steps` is set)
    steps: int | None = None  # optimizer steps; null: epochs x ceil(train rows / batch_size)
    batch_size: int = 8  # conversations per optimizer step (all data-parallel ranks together)
    token_budget: int = 4096  # tokens per micro-batch (rows x padded length)
    pack_rows: str = "auto"  # as trainer.pack_rows: auto (CUDA, bf16, varlen flash) | true | false
    eval_every: int = 0  # held-out loss every N steps (0: at the start and the end only)
    save_every: int = 0  # checkpoint every N steps (0: at the end only)
    keep_checkpoints: int = 2  # newest checkpoints kept (0: all)
    resume: str = "auto"  # auto: continue from run.dir/checkpoints/latest | never
    export_hf: bool = True  # run.dir/hf at the end (RL starts from it: model.source=hf model.hf_path=...)

    def __post_init__(self) -> None:
        for key in ("max_length", "epochs", "batch_size", "token_budget"):
            positive(f"sft.{key}", getattr(self, key))
        if self.steps is not None:
            positive("sft.steps", self.steps, allow_zero=True)
        for key in ("eval_every", "save_every", "keep_checkpoints"):
            positive(f"sft.{key}", getattr(self, key), allow_zero=True)
        one_of("sft.resume", self.resume, ("auto", "never"))
        self.pack_rows = str(self.pack_rows).lower()
        one_of("sft.pack_rows", self.pack_rows, ("auto", "true", "false"))


@dataclass
class SftMainConfig:
    seed: int = 1234
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    optim: OptimSettings = field(default_factory=OptimSettings)
    sft: SftConfig = field(default_factory=SftConfig)


def register_sft_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SFT_SCHEMA, node=SftMainConfig)


def _refuse_undeclared(node: DictConfig, schema: type, where: str) -> None:
    """A key forced past Hydra's struct check (`+sft.stpes=3`) is an error, as in the RL config."""
    declared = {f.name: f for f in fields(schema)}
    for key in node.keys():
        name = f"{where}.{key}" if where else str(key)
        if key not in declared:
            raise ConfigError(f"{name}: Key '{key}' not in '{schema.__name__}'")
        child_schema = OmegaConf.get_type(node, key)
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and child_schema not in (None, dict):
            _refuse_undeclared(child, child_schema, name)


def load_sft_config(cfg: DictConfig) -> SftMainConfig:
    """The composed config as typed objects, converted once; one-line errors naming the field."""
    from omegaconf.errors import OmegaConfBaseException

    _refuse_undeclared(cfg, SftMainConfig, "")
    try:
        return OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except OmegaConfBaseException as e:
        if isinstance(e.__cause__, ConfigError):
            raise e.__cause__ from None
        line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{getattr(e, 'full_key', '') or 'config'}: {line}") from None
