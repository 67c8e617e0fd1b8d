"""`reward.rm.placement=trainer`: the reward model runs on the trainer's own ranks, sharded like the reference model.

Rank 0 scores (it owns the samples, the reward and the engine), but the Megatron RM (policy/score_model.py) is one
model over all ranks (TP/PP/DP), so every rank must join each forward. The other ranks are idle at exactly those
times: waiting for the round's broadcast (`Rounds.next`) or for the evaluation to end (`Evaluator`). There they
`serve()`: receive ("score", part, rows) from rank 0, run the collective forward, until rank 0 says "done". Rank 0
opens such a window with `session()` around its scoring and closes it before the round broadcast / after the
evaluation, so no message is ever waited for outside it. One process: no messages, just the model.

Only the main thread may score: an environment under an async schedule scores from its episode threads while the
main thread trains, and the other ranks are then not listening (that case is refused in one line: use
`placement=server`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

from mcore_rl.distributed import broadcast_object, global_rank

SCORE, DONE = "score", "done"


class RewardService:
    """The run's trainer-placed reward models by reward part, and rank 0's channel to the other ranks."""

    def __init__(self, models: Mapping[str, Any]):
        import torch.distributed as dist

        self.models = dict(models)
        self.rank = global_rank()
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self._open = False  # rank 0: inside a session (the other ranks are serving)

    def scorers(self) -> dict[str, TrainerScorer]:
        """What `build_reward(cfg, scorers=...)` takes: one TokenScorer per rm part (used on rank 0)."""
        return {part: TrainerScorer(self, part) for part in self.models}

    @contextmanager
    def session(self) -> Iterator[None]:
        """Rank 0, around a round's or an evaluation's scoring: the other ranks serve until it ends."""
        self._open = True
        try:
            yield
        finally:
            self._open = False
            if self.world > 1:
                broadcast_object((DONE,))

    def serve(self) -> int:
        """Ranks other than 0: join rank 0's RM forwards until it says done; returns how many were served."""
        n = 0
        while True:
            msg = broadcast_object(None)
            if msg[0] == DONE:
                return n
            _, part, rows = msg
            self.models[part].score_ids(rows)
            n += 1

    def score(self, part: str, rows: list[list[int]]) -> list[float]:
        """Rank 0: the scores of `rows` with part `part`'s RM (every rank joins the forward)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                f"reward.{part}.placement=trainer was asked to score from thread "
                f"{threading.current_thread().name!r} (an environment under an async schedule?); the trainer's "
                f"ranks score only from the main thread: use reward.{part}.placement=server"
            )
        model = self.models[part]
        model.check_rows(rows)  # a bad row fails here, before the other ranks are involved
        if self.world > 1:
            if self.rank != 0 or not self._open:
                raise RuntimeError(
                    f"reward.{part}.placement=trainer: scored on rank {self.rank} outside a round or an "
                    "evaluation, where the other ranks are not serving the reward model"
                )
            broadcast_object((SCORE, part, rows))
        return model.score_ids(rows)


class TrainerScorer:
    """The TokenScorer (rewards/reward_model.py) of one rm part scored on the trainer's ranks."""

    def __init__(self, service: RewardService, part: str):
        self.service, self.part = service, part

    def score_ids(self, rows: list[list[int]]) -> list[float]:
        return self.service.score(self.part, rows)

    def close(self) -> None:
        """Nothing to release here: the model's shards live as long as the trainer's processes."""


def session(service: RewardService | None):
    """`service.session()`, or nothing when the run has no trainer-placed reward model (rank 0's side)."""
    return service.session() if service is not None else nullcontext()


def trainer_rm_parts(reward_cfg: Any) -> dict[str, Any]:
    """The rm parts of the `reward` group with placement=trainer: part name -> its RewardModelConfig."""
    from mcore_rl.rewards.registry import part_options
    from mcore_rl.rewards.reward_model import RewardModelConfig
    from mcore_rl.utils import config_from_dict

    out = {}
    for part, (kind, options) in part_options(reward_cfg).items():
        if kind == "rm":
            rm = config_from_dict(RewardModelConfig, options, f"reward.{part}")
            if rm.placement == "trainer":
                out[part] = rm
    return out


def check_trainer_rms(reward_cfg: Any, tp: int, pp: int, world: int | None = None) -> None:
    """Before any model is built: each trainer-placed RM is an architecture we build, at this TP/PP (one line
    naming reward.<part>.path otherwise)."""
    from mcore_rl.models.base import read_hf_config
    from mcore_rl.models.seq_cls import score_family_for
    from mcore_rl.models.spec import validate_parallel

    for part, rm in trainer_rm_parts(reward_cfg).items():
        try:
            hf = read_hf_config(rm.path)
            validate_parallel(score_family_for(hf).args(hf), tp, pp, world)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"reward.{part}.path={rm.path}: {e}") from None


def build_reward_service(
    reward_cfg: Any, build: Any, token_budget: int, packed: bool
) -> RewardService | None:
    """On every rank: a ScoreModel per trainer-placed rm part (TP/PP, dtype of `build`: the reference model's), or
    None when there is none. Collective (every rank builds its shards)."""
    from mcore_rl.policy.score_model import ScoreModel

    parts = trainer_rm_parts(reward_cfg)
    if not parts:
        return None
    models = {part: ScoreModel(rm.path, build, token_budget=token_budget, packed=packed, label=rm.label,
                               where=f"reward.{part}")
              for part, rm in parts.items()}  # fmt: skip
    return RewardService(models)
