"""`build(cfg)`: a run's components from its typed config, each given only the settings and parts it uses.

Rank 0 owns the rollout engine, the prompts, the reward and the compute meter (None on the other ranks); every
rank owns its policy shard. The order matters only where a part needs another: the prompts load before the model
(a missing data field fails in seconds), the engine follows the policy (it runs in the policy's resolved dtype),
and the run resumes last, once every stateful part exists.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mcore_rl.algorithms import Algorithm, build_algorithm
from mcore_rl.config import MainConfig, TrainerConfig
from mcore_rl.config.trainer import resolve_deterministic
from mcore_rl.distributed import broadcast_object, describe_groups, init_distributed
from mcore_rl.policy.policy import Policy
from mcore_rl.policy.precision import configure_bf16_matmul, engine_dtype, resolve_dtype
from mcore_rl.trainer.checkpointer import Checkpointer
from mcore_rl.trainer.heldout import Evaluator
from mcore_rl.trainer.learner import Learner, reuses_old_logp
from mcore_rl.trainer.models import load_policies, make_engine
from mcore_rl.trainer.rounds import PromptsLog, Rounds
from mcore_rl.trainer.runlog import RunLog
from mcore_rl.trainer.schedule import Schedule, ScheduleContext, schedule_class
from mcore_rl.trainer.setup import (
    ConfigError,
    StopFlag,
    check_model_against_parallel,
    resolve_model_dir,
    warn_small_gpu_budget,
)
from mcore_rl.trainer.state import RunState
from mcore_rl.trainer.update import NonFiniteGuard
from mcore_rl.trainer.weights import WeightSync, sync_options

log = logging.getLogger("mcore_rl")


@dataclass
class Components:
    """Everything a run is made of; trainer/loop.py calls them in the order of an RL round."""

    settings: TrainerConfig
    rank: int
    run_dir: Path
    model_dir: Path
    policy: Policy
    algorithm: Algorithm
    schedule: Schedule
    oldlogp: Any  # mcore_rl.oldlogp source: the round's old log-probs
    rounds: Rounds  # generate + score (rank 0), broadcast
    learner: Learner  # anchors + optimizer updates
    weights: WeightSync  # new weights into the engine, versions to the old-log-prob source
    evaluator: Evaluator
    checkpointer: Checkpointer
    runlog: RunLog
    prompts_log: PromptsLog
    stop: StopFlag
    engine: Any = None  # rank 0
    reward_fn: Any = None  # rank 0
    episodes: Any = None  # rank 0 with env=NAME: the episode launcher (trainer/episodes.py)

    def close(self) -> None:
        """Rank 0 at the end: rounds generated ahead that no update will consume, logs, reward workers, engine."""
        if self.rank != 0:
            return
        self.schedule.close()
        if self.episodes is not None:
            self.episodes.close()
            self.episodes.source.close()
        self.prompts_log.close()
        self.runlog.close()
        if self.reward_fn is not None:
            self.reward_fn.close()
        self.engine.close()


@dataclass(frozen=True)
class Layout:
    rank: int
    dp: int
    dp_rank: int
    run_dir: Path


def _preflight(cfg: MainConfig) -> bool:
    """One-line errors before anything heavy; returns whether the run is deterministic (trainer.deterministic)."""
    import os

    from mcore_rl.rollout.sglang.preflight import missing_server

    # rollout=sglang launching servers here without SGLang installed: only the launching rank (global 0) checks
    if os.environ.get("RANK", "0") == "0" and (msg := missing_server(dataclasses.asdict(cfg.rollout))):
        raise ConfigError(msg)
    if cfg.env is None:  # reward keys, reward.function's import, reward.remote's key file: before any model
        from mcore_rl.rewards import check_reward

        check_reward(cfg.reward)
        _check_trainer_rms(cfg)
    deterministic = resolve_deterministic(cfg.trainer.deterministic, cfg.rollout.engine)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    return deterministic


def _distributed(cfg: MainConfig) -> Layout:
    p = cfg.parallel
    layout = init_distributed(p.tp, p.pp, seed=cfg.seed, ep=p.ep, timeout_s=cfg.trainer.dist_timeout_s)
    log.warning(describe_groups())
    from megatron.core import parallel_state as ps

    return Layout(
        layout.rank,
        layout.dp,
        ps.get_data_parallel_rank(),
        Path(broadcast_object(str(Path(cfg.run.dir).resolve()))),
    )


def _prompt_source(cfg: MainConfig, model_dir: Path) -> Any:
    from mcore_rl.trainer.prompts import PromptSource

    t = cfg.trainer
    if cfg.env is not None:  # env=NAME: the environment's records start episodes (trainer/episodes.py)
        from mcore_rl.trainer.episodes import EnvPromptSource

        return EnvPromptSource(dict(cfg.env), cfg.eval, model_dir, seed=cfg.seed,
                               prompts_per_update=t.prompts_per_update,
                               retire_pass_rate=cfg.algorithm.retire_pass_rate)  # fmt: skip
    return PromptSource(
        cfg.data,
        cfg.eval,
        model_dir,
        seed=cfg.seed,
        prompts_per_update=t.prompts_per_update,
        max_new_tokens=t.max_new_tokens,
        retire_pass_rate=cfg.algorithm.retire_pass_rate,
    )


def config_record(cfg: MainConfig, dtype: str) -> MainConfig:
    """The config as the run used it (run.dir/config.yaml, wandb): model.dtype as resolved (auto -> measured)."""
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype))


def build(cfg: MainConfig) -> tuple[Components, RunState]:
    """Every component, the run resumed from its newest checkpoint (trainer.resume=auto) or fresh."""
    deterministic = _preflight(cfg)
    model_dir = resolve_model_dir(cfg.model)
    check_model_against_parallel(cfg, model_dir)
    lay = _distributed(cfg)
    if lay.rank == 0:
        warn_small_gpu_budget(cfg.trainer.token_budget)
    algorithm = build_algorithm(cfg.algorithm)
    sched_cls = schedule_class(cfg.algorithm.schedule)
    data = _prompt_source(cfg, model_dir) if lay.rank == 0 else None  # before the model: data errors fail fast
    dtype = resolve_dtype(cfg.model.dtype)  # auto -> measured once; every part below gets the resolved value
    configure_bf16_matmul(cfg.model.bf16_matmul, {dtype, engine_dtype(getattr(cfg.rollout, "dtype", None), dtype)})
    p = _Parts(*load_policies(cfg, model_dir, dtype, algorithm), engine=None, reward_fn=None, data=data, compute=None)
    _log_start(cfg, p.policy, lay.rank)
    p.rm_service = _reward_models(cfg, dtype)  # every rank: reward.rm.placement=trainer (None without one)
    if cfg.env is not None and lay.rank != 0:
        from mcore_rl.trainer.episodes import build_env

        build_env(dict(cfg.env))  # every rank refuses a bad env key, not only the one that runs episodes
    if lay.rank == 0:
        from mcore_rl.evaluation.compute import ComputeMeter, model_flops
        from mcore_rl.rewards import build_reward, describe

        p.engine = make_engine(cfg.rollout, sched_cls, model_dir, dtype, deterministic, cfg.seed)
        scorers = p.rm_service.scorers() if p.rm_service is not None else None
        if cfg.env is None:  # env=NAME: the environment rewards
            p.reward_fn = build_reward(cfg.reward, scorers=scorers)
        if p.reward_fn is not None:
            log.warning("reward: %s", describe(p.reward_fn))  # parts, weights, limits, function path, url host
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        p.compute = ComputeMeter(model_flops(model_dir), world, torch.cuda.is_available())
    record = config_record(cfg, dtype)
    runlog = RunLog(lay.run_dir, cfg.logging, cfg.trainer.steps, lay.rank == 0, dataclasses.asdict(record), dtype)
    state, stop = RunState(), StopFlag()
    stop.install()
    if lay.rank == 0 and cfg.env is not None:
        from mcore_rl.trainer.episodes import EpisodeLauncher

        p.episodes = EpisodeLauncher(data, p.engine)
    ctx = ScheduleContext(cfg.algorithm, cfg.trainer, cfg.seed, deterministic, state, stop, p.engine, data,
                          episodes=p.episodes)  # fmt: skip
    schedule = sched_cls(ctx)
    if cfg.partial_rollout.enabled:  # over-issued rounds, unfinished samples carried (trainer/partial.py)
        from mcore_rl.oldlogp.registry import SOURCES
        from mcore_rl.trainer.partial import PartialSchedule

        restart = SOURCES.get(cfg.algorithm.old_logp_source).needs_interrupt
        schedule = PartialSchedule(schedule, cfg.partial_rollout, lay.run_dir if lay.rank == 0 else None, restart)
    oldlogp = _oldlogp_source(cfg, model_dir, dtype, p.policy, p.engine, schedule.depth)
    c = _assemble(cfg, lay, model_dir, algorithm, schedule, oldlogp, p, stop, runlog)
    c.checkpointer.restore(state)
    if lay.rank == 0:
        from omegaconf import OmegaConf

        (lay.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(record)))
    return c, state


def _check_trainer_rms(cfg: MainConfig) -> None:
    """reward.rm.placement=trainer: the RM's architecture and its split over parallel.tp / parallel.pp, one line."""
    import os

    from mcore_rl.trainer.reward_service import check_trainer_rms

    try:
        check_trainer_rms(cfg.reward, cfg.parallel.tp, cfg.parallel.pp, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _reward_models(cfg: MainConfig, dtype: str) -> Any:
    """The Megatron reward models of rm parts with placement=trainer (trainer/reward_service.py), built like the
    frozen reference model: the run's TP/PP and resolved dtype, its token budget, no optimizer."""
    if cfg.env is not None:
        return None
    from mcore_rl.trainer.reward_service import build_reward_service
    from mcore_rl.trainer.setup import policy_config

    pcfg = policy_config(cfg, dtype)
    try:
        return build_reward_service(cfg.reward, pcfg.build, pcfg.token_budget, pcfg.packed)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _log_start(cfg: MainConfig, policy: Policy, rank: int) -> None:
    """The start-up lines a user checks first, at the default log level on rank 0 only: how many parameters train
    (every weight, or LoRA's adapters), and the run's plugins with what each registered."""
    from mcore_rl import plugins

    trainable, total = _parameter_counts(policy.model)
    if rank != 0:
        return
    lora = f", LoRA rank {cfg.model.lora.rank}" if cfg.model.lora.enabled else ""
    log.warning(f"parameters: {trainable:,} of {total:,} train ({100.0 * trainable / max(total, 1):.2f}%{lora})")
    if line := plugins.summary(cfg.plugins):
        log.warning(line)


def _parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters of the whole model, summed over ranks (a collective: every rank calls it).
    Each tensor-parallel shard counts once, a replicated tensor on tensor-parallel rank 0 only, the last pipeline
    stage's copy of tied embeddings not at all, and one data-parallel replica (an expert: one per expert-parallel
    shard)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    from mcore_rl.distributed import all_reduce

    dp0, edp0 = ps.get_data_parallel_rank() == 0, ps.get_expert_data_parallel_rank() == 0
    counts = torch.zeros(2, dtype=torch.int64)
    for param in model.parameters():
        replica0 = edp0 if not getattr(param, "allreduce", True) else dp0  # experts: allreduce=False
        if replica0 and not getattr(param, "shared", False) and param_is_not_tensor_parallel_duplicate(param):
            counts += torch.tensor([param.numel() if param.requires_grad else 0, param.numel()])
    trainable, total = all_reduce(counts, "sum").tolist()
    return int(trainable), int(total)


def _oldlogp_source(
    cfg: MainConfig, model_dir: Path, dtype: str, policy: Policy, engine: Any, depth: int
) -> Any:
    from mcore_rl.oldlogp import SourceContext, build_source
    from mcore_rl.trainer.setup import policy_config

    ac = cfg.algorithm
    return build_source(
        ac.old_logp_source,
        SourceContext(
            policy=policy,
            temperature=cfg.trainer.temperature,
            staleness=depth,
            engine=engine,
            make_policy=lambda: Policy(model_dir, policy_config(cfg, dtype), trainable=False),
            audit_frac=ac.old_logp_audit_frac,
            seed=cfg.seed,
        ),
    )


@dataclass
class _Parts:
    """The pieces several components share; the rank-0 ones (engine, reward, data, compute) are None elsewhere."""

    policy: Policy
    ref: Any
    ewma: Any
    engine: Any
    reward_fn: Any
    data: Any
    compute: Any
    episodes: Any = None
    rm_service: Any = None  # reward.rm.placement=trainer: the reward models on every rank


def _round_parts(
    cfg: MainConfig, lay: Layout, algorithm: Algorithm, schedule: Schedule, oldlogp: Any, p: _Parts
) -> tuple[Rounds, Learner, PromptsLog]:
    t = cfg.trainer
    reuse = reuses_old_logp(t.reuse_old_logp, oldlogp, algorithm, schedule.updates_per_round, p.policy)
    if reuse and lay.rank == 0:
        log.info("old_logp: from each update's own forward (recompute, one update per round; "
                 "trainer.reuse_old_logp=false runs a separate scoring forward)")
    passes = int(algorithm.needs_old_logp and not reuse) + int(p.ref is not None) + int(p.ewma is not None)
    rounds = Rounds(schedule, lay.rank, t.samples_per_prompt, t.prompts_per_update, cfg.algorithm, data=p.data,
                    reward_fn=p.reward_fn, compute=p.compute, engine=p.engine, scoring_passes=passes,
                    episodes=cfg.env is not None, mask_stale=cfg.partial_rollout.enabled and cfg.partial_rollout.mask_stale,
                    rm_service=p.rm_service)  # fmt: skip
    prompts_log = PromptsLog(lay.run_dir / "prompts.jsonl", enabled=lay.rank == 0)
    guard = NonFiniteGuard(max_consecutive=t.max_nonfinite_skips)
    learner = Learner(p.policy, algorithm, oldlogp, guard, t.temperature, lay.dp, lay.dp_rank, prompts_log,
                      ref=p.ref, ewma=p.ewma, skip_inert_rows=t.skip_inert_rows, reuse_old_logp=reuse)  # fmt: skip
    return rounds, learner, prompts_log


def _assemble(
    cfg: MainConfig, lay: Layout, model_dir: Path, algorithm: Algorithm, schedule: Schedule, oldlogp: Any,
    p: _Parts, stop: StopFlag, runlog: RunLog,
) -> Components:  # fmt: skip
    t = cfg.trainer
    rounds, learner, prompts_log = _round_parts(cfg, lay, algorithm, schedule, oldlogp, p)
    finished = schedule.finished_samples if lay.rank == 0 else None
    if p.episodes is not None:  # episodes: the unit an old-logit model scores at its version is the finished turn
        finished = p.episodes.finished_turns
    weights = WeightSync(p.policy, p.engine, cfg.rollout.sync_mode, sync_options(cfg.rollout, model_dir),
                         t.sync_weights, oldlogp, finished)  # fmt: skip
    evaluator = Evaluator(cfg.eval, lay.run_dir, runlog, engine=p.engine, reward_fn=p.reward_fn, data=p.data,
                          compute=p.compute, rm_service=p.rm_service)  # fmt: skip
    checkpointer = Checkpointer(lay.run_dir, t, lay.rank, p.policy, algorithm, schedule, oldlogp, weights,
                                ewma=p.ewma, data=p.data, compute=p.compute,
                                from_mcore_ckpt=bool(cfg.model.mcore_ckpt))  # fmt: skip
    return Components(t, lay.rank, lay.run_dir, model_dir, p.policy, algorithm, schedule, oldlogp, rounds, learner,
                      weights, evaluator, checkpointer, runlog, prompts_log, stop, engine=p.engine,
                      reward_fn=p.reward_fn, episodes=p.episodes)  # fmt: skip
