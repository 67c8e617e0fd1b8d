"""A frozen Megatron reward model: an HF `*ForSequenceClassification` folder as a (TP/PP-sharded) GPTModel whose
output layer is the score head, scoring token-id rows exactly as transformers does.

Why in Megatron rather than transformers: the trainer's ranks already hold a Megatron layout (TP/PP), so an RM that
does not fit one process, or one GPU, runs sharded like the frozen reference model, with no second runtime. The
decoder is the causal family's (models/seq_cls.py: one weight mapping); only the head differs. Each row is cut
after the token HF scores (causal attention: later tokens cannot change it), rows are micro-batched by a token
budget (`policy/step.split_micro_batches`), split over the data-parallel replicas, and the score head runs on the
final-norm hidden state of that one token per row on the last pipeline stage; the scores are gathered on rank 0.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from mcore_rl.models.base import ModelArgs, read_hf_config
from mcore_rl.models.hf_io import HFReader
from mcore_rl.models.seq_cls import score_family_for, score_index
from mcore_rl.models.spec import BuildConfig, validate_parallel
from mcore_rl.policy.build import build_gpt_model, unwrap
from mcore_rl.policy.hf_weights import load_hf_into_model
from mcore_rl.policy.precision import resolve_dtype
from mcore_rl.policy.score_forward import score_micro_batches

log = logging.getLogger("mcore_rl")


class ScoreHead(torch.nn.Module):
    """The score head in the output layer's place: a bias-free [num_labels, hidden] matrix, replicated on every
    tensor-parallel rank (num_labels is tiny and need not divide TP). Megatron checkpoints it as
    `output_layer.weight`, like any replicated tensor."""

    def __init__(self, num_labels: int, hidden: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.zeros(num_labels, hidden, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        """Megatron's output-layer call signature (GPTModel's own post-process path): logits [.., num_labels]."""
        return torch.nn.functional.linear(hidden, self.weight if weight is None else weight), None

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, num_labels] in fp32 (the head is a few dot products: no reason to round them)."""
        return hidden.float() @ self.weight.float().t()


def attach_score_head(model, args: ModelArgs) -> None:
    """Replace the last stage's LM head by the score head (before loading weights; other stages have none)."""
    gpt = unwrap(model)
    if not gpt.post_process:
        return
    old = gpt.output_layer
    dtype = gpt.config.params_dtype
    gpt.output_layer = ScoreHead(args.num_labels, args.hidden_size, dtype, old.weight.device)


def build_score_gpt(args: ModelArgs, build: BuildConfig, *, trainable: bool = False, wrap_ddp: bool = False):
    """This rank's stage of the reward model: the decoder as the policy builds it, with the score head.
    `trainable=False` (the trainer's RM): no DDP, no gradient buffers, every parameter frozen."""
    model = build_gpt_model(args, build, trainable=trainable, wrap_ddp=wrap_ddp)
    attach_score_head(model, args)
    return model


class ScoreModel:
    """Scores token-id rows with a frozen Megatron copy of an HF sequence classifier (every rank holds its shard).

    `scores`/`score_ids` are collective: every rank calls them with the same rows (trainer/reward_service.py does
    that); rank 0 gets the result, the others an empty result.
    """

    def __init__(
        self,
        folder: str | Path,
        build: BuildConfig,
        *,
        token_budget: int = 4096,
        packed: bool = False,
        label: int = 0,
        where: str = "reward.rm",
    ):
        self.folder = Path(folder)
        hf = read_hf_config(self.folder)
        try:
            self.family = score_family_for(hf)
            self.args = self.family.args(hf)
        except ValueError as e:
            raise ValueError(f"{where}.path={self.folder}: {e}") from None
        if not 0 <= label < self.args.num_labels:
            raise ValueError(f"{where}.label={label}: {self.folder} has num_labels={self.args.num_labels}")
        self.label, self.token_budget, self.packed = label, token_budget, packed
        self.pad_id = hf.get("pad_token_id")  # HF reads config.pad_token_id (the text config's)
        # forward-only: sequence parallelism would only scatter the hidden states this model reads per row
        self.build = dataclasses.replace(build, dtype=resolve_dtype(build.dtype), sequence_parallel=False)
        try:
            validate_parallel(self.args, self.build.tp, self.build.pp, torch.distributed.get_world_size())
        except ValueError as e:
            raise ValueError(f"{where}.path={self.folder}: {e}") from None
        self.model = build_score_gpt(self.args, self.build)
        with HFReader(self.folder) as reader:
            load_hf_into_model(self.model, self.family, self.args, reader)
            total = sum(_numel(reader.shape(n)) for n in reader.names())
        self._log_memory(total)

    def _log_memory(self, total_params: int) -> None:
        """One line: the model's size and the most parameter memory any rank holds (a collective)."""
        from mcore_rl.distributed import all_reduce, global_rank

        local = sum(p.numel() * p.element_size() for p in self.model.parameters())
        peak = int(all_reduce(torch.tensor([local], dtype=torch.int64), "max").item())
        if global_rank() == 0:
            log.warning(
                f"reward model {self.folder.name} ({self.args.architecture}, {self.build.dtype}, "
                f"tp={self.build.tp} pp={self.build.pp}): {total_params / 1e6:.1f}M parameters, "
                f"{peak / 2**20:.0f} MiB of parameters on the largest rank (frozen: no gradients, "
                f"no optimizer state)"
            )

    def check_rows(self, rows: list[list[int]]) -> None:
        """Refuse (one line) an empty row or a token id outside the RM's vocabulary."""
        V = self.args.vocab_size
        for i, row in enumerate(rows):
            if len(row) == 0:
                raise ValueError(f"reward model {self.folder.name}: row {i} is empty (nothing to score)")
            if min(row) < 0 or max(row) >= V:
                raise ValueError(f"reward model {self.folder.name}: row {i} has token ids outside [0, {V})")

    @torch.no_grad()
    def scores(self, rows: list[list[int]]) -> torch.Tensor | None:
        """All logits [len(rows), num_labels] (fp32) on global rank 0, None on the others. Collective."""
        from megatron.core import parallel_state as ps

        self.check_rows(rows)
        # each row ends at the token HF scores: later tokens cannot change it (causal attention)
        cut = [list(r[: score_index(r, self.pad_id) + 1]) for r in rows]
        # each data-parallel replica scores its share of the rows; under expert parallelism every replica runs the
        # same micro-batches (its token dispatch is a collective across them) and replica 0 reports
        split = ps.get_expert_model_parallel_world_size() == 1
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        mine = list(range(dp_rank, len(cut), dp)) if split else list(range(len(cut)))
        local = score_micro_batches(self.model, [cut[i] for i in mine], self.token_budget, self.packed)
        report = None
        if local is not None and ps.get_tensor_model_parallel_rank() == 0 and (split or dp_rank == 0):
            report = (mine, local)  # the last stage, TP rank 0 of each (reporting) replica
        return _gather_on_rank0(report, len(rows), self.args.num_labels)

    def score_ids(self, rows: list[list[int]]) -> list[float]:
        """The `label` column: one float per row on rank 0 (order kept); [] on the other ranks. Collective."""
        out = self.scores(rows)
        return [] if out is None else out[:, self.label].tolist()

    def close(self) -> None:
        """Drop the weights (the trainer keeps no reference afterwards)."""
        self.model = None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _gather_on_rank0(report, n_rows: int, n_labels: int) -> torch.Tensor | None:
    """Every reporting rank's (row indices, scores) assembled on global rank 0, over the host (gloo) group."""
    from mcore_rl.distributed import gather_objects

    parts = gather_objects(report, dst=0)
    if parts is None:
        return None
    out = torch.full((n_rows, n_labels), float("nan"))
    for part in filter(None, parts):
        idx, scores = part
        if idx:
            out[torch.tensor(idx)] = scores
    return out
