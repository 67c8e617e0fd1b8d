"""A run's components and the per-phase operations the loop calls. Rank 0 owns the engine, data and rewards;
every rank owns its policy shard. Samples travel from rank 0 to all ranks by broadcast."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from mcore_rl.agreement import FatalRunError
from mcore_rl.algorithms import build_algorithm
from mcore_rl.batch import RolloutBatch, build_rollout_batch, update_rows
from mcore_rl.config.trainer import resolve_deterministic
from mcore_rl.distributed import broadcast_object, describe_groups, init_distributed
from mcore_rl.evaluation.runner import evaluate_sets
from mcore_rl.metrics_log import MetricsLogger, memory_gb, plot_run
from mcore_rl.policy.policy import Policy
from mcore_rl.rollout.weight_sync.megatron_sync import sync_weights
from mcore_rl.rollout.weight_sync.transports import TRAINER_KEYS, SyncOptions
from mcore_rl.trainer import prompts as prompt_src
from mcore_rl.trainer.rounds import PromptsLog, produce
from mcore_rl.trainer.schedule import build_schedule
from mcore_rl.trainer.setup import (
    StopFlag,
    algorithm_spec,
    check_model_against_parallel,
    policy_config,
    resolve_model_dir,
    validate_config,
)
from mcore_rl.trainer.state import checkpoint, latest_checkpoint, latest_update, resume_or_start
from mcore_rl.trainer.update import NonFiniteGuard, run_update

log = logging.getLogger("mcore_rl")


class Run:
    def __init__(self, cfg: DictConfig):
        validate_config(cfg)  # one-line errors before anything heavy
        self.cfg = cfg
        self._check_rollout_server()
        self.deterministic = resolve_deterministic(cfg.trainer.deterministic, cfg.rollout.engine)
        if self.deterministic:
            torch.set_num_threads(max(1, torch.get_num_threads()))
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.model_dir = resolve_model_dir(cfg)
        check_model_against_parallel(cfg, self.model_dir)
        layout = init_distributed(cfg.parallel.tp, cfg.parallel.pp, seed=cfg.seed, ep=cfg.parallel.ep,
                                  timeout_s=cfg.trainer.dist_timeout_s)
        log.warning(describe_groups())
        self.rank, self.dp = layout.rank, layout.dp
        from megatron.core import parallel_state as ps

        self.dp_rank = ps.get_data_parallel_rank()
        self.run_dir = Path(broadcast_object(str(Path(cfg.run.dir).resolve())))
        self.algorithm = build_algorithm(algorithm_spec(cfg))
        ac = self.algorithm.config
        # sync / staged / async: when generation is submitted, what happens around training (trainer/schedule/)
        self.schedule = build_schedule(self)
        # rank 0: data, rewards, engine, logger (data first: a missing field fails before the model is built)
        self.data = prompt_src.PromptSource(cfg, self.model_dir, self.algorithm) if self.rank == 0 else None
        self.policy = Policy(self.model_dir, policy_config(cfg))
        OmegaConf.update(cfg, "model.dtype", self.policy.cfg.build.dtype)  # auto -> what was measured, recorded
        self.ref = None
        if self.algorithm.needs_ref_logp:
            self.ref = Policy(self.model_dir, policy_config(cfg), trainable=False)
        self.ewma = None
        self._init_weights()
        self._load_check()
        if self.algorithm.needs_prox_logp:
            from mcore_rl.algorithms import EwmaWeights

            self.ewma = EwmaWeights(list(self.policy.model.parameters()), beta=ac.ewma_beta)
        self.engine = self.reward_fn = None
        if self.rank == 0:
            from mcore_rl.rewards import build_reward
            from mcore_rl.rollout.protocol import build_engine

            rc = OmegaConf.to_container(cfg.rollout, resolve=True)
            name = rc.pop("engine", "local")
            for key in TRAINER_KEYS:  # the trainer's side of weight sync
                rc.pop(key, None)
            rc = self.schedule.engine_options(rc)
            from mcore_rl.rollout.sglang.preflight import engine_determinism

            rc = engine_determinism(rc, self.deterministic)  # seeded servers for a deterministic run
            if "dtype" in rc:  # auto: the engine runs in the trainer's (resolved) dtype
                from mcore_rl.policy.precision import engine_dtype

                rc["dtype"] = engine_dtype(rc["dtype"], self.policy.cfg.build.dtype)
            self.engine = build_engine(name, model_path=str(self.model_dir), seed=cfg.seed, **rc)
            if rc.get("worker_urls"):
                log.warning("rollout engine %s: /generate via %s; weight updates and control calls to %s", name,
                            rc.get("router_url") or "the workers", ", ".join(rc["worker_urls"]))
            self.reward_fn = build_reward(OmegaConf.to_container(cfg.reward, resolve=True))
        self.logger = MetricsLogger(self.run_dir, cfg.logging, enabled=self.rank == 0,
                                    config=OmegaConf.to_container(cfg, resolve=True))
        self.guard = NonFiniteGuard(max_consecutive=cfg.trainer.max_nonfinite_skips)
        self.stop = StopFlag()
        self.stop.install()
        self.update = 0
        self.round = 0
        self.version = 0
        self.next_eval = 0
        self._round_prompts: list[str] = []
        self.prompts_log = PromptsLog(self.run_dir / "prompts.jsonl", enabled=self.rank == 0)
        self.last_eval: int | None = None
        self._progress = None
        self._last_heldout: float | None = None
        self.compute = None
        if self.rank == 0:  # FLOPs / wall-clock accounting, written with every eval record
            from mcore_rl.evaluation.compute import ComputeMeter, model_flops

            self.compute = ComputeMeter(model_flops(self.model_dir), dist.get_world_size() if dist.is_initialized()
                                        else 1, torch.cuda.is_available())
        self._resume_or_start()
        # >>> oldlogp hook 1/3: the old-log-prob source (mcore_rl/oldlogp), told about the starting version
        from mcore_rl.oldlogp import SourceContext, build_source

        self.oldlogp = build_source(ac.old_logp_source, SourceContext(
            policy=self.policy, temperature=cfg.trainer.temperature, staleness=self.schedule.depth, engine=self.engine,
            make_policy=lambda: Policy(self.model_dir, policy_config(cfg), trainable=False),
            audit_frac=ac.old_logp_audit_frac, seed=cfg.seed))
        if self.resumed_oldlogp:  # the versions restored in-flight samples were generated with
            self.oldlogp.load_state_dict(self.resumed_oldlogp)
        self.oldlogp.on_version(self.version, self._finished_samples if self.rank == 0 else None)
        # <<< oldlogp hook 1/3

    def _finished_samples(self) -> list:
        """oldlogp: the finished, not yet consumed samples of the rounds in flight (rank 0)."""
        out = []
        for rnd in self.schedule.pending:
            for r in rnd.requests:
                if r.futures is None:  # restored from a checkpoint: already collected
                    out.extend(r.samples or [])
                    continue
                out.extend(f.result() for f in r.futures if f.done() and not f.cancelled() and f.exception() is None)
        return out

    # ---- setup helpers -----------------------------------------------------------------------------------
    def _check_rollout_server(self) -> None:
        """rollout=sglang launching servers here without SGLang installed: one line (exit 2), not a traceback
        after the model is built. Only the launching rank (global rank 0) checks."""
        import os

        from mcore_rl.rollout.sglang.preflight import missing_server
        from mcore_rl.trainer.setup import ConfigError

        if os.environ.get("RANK", "0") == "0" and (msg := missing_server(OmegaConf.to_container(self.cfg.rollout))):
            raise ConfigError(msg)

    def _init_weights(self) -> None:
        from mcore_rl.checkpoint_io import load_dist_checkpoint

        for pol in filter(None, (self.policy, self.ref)):
            if self.cfg.model.mcore_ckpt:
                load_dist_checkpoint(self.cfg.model.mcore_ckpt, pol.model)
                pol._sync_main_params()
            else:
                pol.load_hf(self.model_dir)

    def _load_check(self) -> None:
        """Megatron vs transformers logits right after the initial weights are loaded (convert/load_check.py)."""
        from mcore_rl.convert.load_check import LoadCheckConfig, run_load_check
        from mcore_rl.trainer.setup import ConfigError

        lc = LoadCheckConfig(**OmegaConf.to_container(self.cfg.model.load_check, resolve=True))
        res = run_load_check(self.policy, self.model_dir, lc, from_hf=not self.cfg.model.mcore_ckpt)
        log.warning(res.line(lc.tol))
        if res.ran and not res.max_abs_diff <= lc.tol:
            raise ConfigError(f"{res.line(lc.tol)}: the {self.policy.args.architecture} adapter's weight mapping "
                              f"does not reproduce {self.model_dir}; refusing to train")

    @property
    def ckpt_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def _resume_or_start(self) -> None:
        resume_or_start(self)

    # ---- phases --------------------------------------------------------------------------------------------
    def next_batch(self, num_updates: int) -> tuple[RolloutBatch, dict[str, float]] | None:
        """The schedule's next round, scored on rank 0 (DAPO: dynamic sampling) and broadcast to every rank.

        None when a stop signal (Slurm preemption) arrived during generation: the schedule aborted what was in
        flight, its state lists those prompts so a resumed run generates them again, and the loop checkpoints
        at once instead of waiting for a long round.
        """
        payload = None
        if self.rank == 0:
            try:
                payload = produce(self, num_updates)
            except FatalRunError as e:  # every rank must stop, not wait in the broadcast below
                payload = str(e)
        payload = broadcast_object(payload)
        if isinstance(payload, str):
            raise FatalRunError(payload)
        if payload is None:
            return None
        self.round += 1
        self._round_prompts = [p.prompt_id for p in payload["prompts"]]
        G = self.cfg.trainer.samples_per_prompt
        samples = payload["samples"]
        rb = build_rollout_batch(samples, payload["rewards"], payload["correct"], [i // G for i in range(len(samples))],
                                 pad_id=0)
        return rb, self._rollout_metrics(rb, payload["metrics"] if self.rank == 0 else {})

    def _rollout_metrics(self, rb: RolloutBatch, rank0: dict[str, float]) -> dict[str, float]:
        lengths = rb.response_len
        metrics = {
            "reward_mean": rb.rewards.mean().item(), "reward_std": rb.rewards.std().item() if len(rb) > 1 else 0.0,
            "accuracy": rb.correct.mean().item(), "response_len": lengths.mean().item(),
            "response_len_max": lengths.max().item(), "truncation_rate": rb.truncated.mean().item(),
            "rollout_tokens": lengths.sum().item(), "weight_version": float(self.version),
        }
        tok_versions = rb.versions[rb.loss_mask > 0].double()
        if tok_versions.numel():  # per-token lag behind the trainer: a weight update mid-sample shows here
            metrics["staleness_max"] = float(self.version - tok_versions.min().item())
            metrics["staleness_mean"] = float(self.version - tok_versions.mean().item())
        if self.rank == 0:
            metrics.update(rank0)
            metrics.update(self.data.metrics())
            if hasattr(self.engine, "fault_metrics"):  # SGLang: HTTP retries, stale samples dropped, restarts
                metrics.update(self.engine.fault_metrics())
        return metrics

    def train_update(self, rb: RolloutBatch, adv, anchors: dict[str, torch.Tensor], u: int,
                     n_up: int) -> dict[str, float]:
        """Optimizer update `u` of the round's `n_up`: its prompt groups, this DP rank's share of them."""
        rows = update_rows(rb.group_ids, n_up, u, self.dp, self.dp_rank)
        part = {k: v[rows] for k, v in anchors.items()}
        t0 = time.perf_counter()
        if self.ewma is not None:  # PPO-EWMA: proximal log-probs under the current EWMA weights
            part["prox_logp"] = self.prox_logp(rb.select(rows))
        metrics = run_update(self.policy, self.algorithm, rb.select(rows), adv.advantages[rows], adv.keep[rows],
                             part, self.cfg.trainer.temperature, self.ewma, guard=self.guard,
                             update_index=self.update + 1)
        self.update += 1
        metrics["time_train"] = time.perf_counter() - t0
        if self.rank == 0:  # which prompts this update trained on: resumed runs are compared by these
            groups = sorted(set(rb.group_ids.tolist()))
            per = -(-len(groups) // n_up)
            self.prompts_log.log(self.update, {"round": self.round,
                                               "prompt_ids": self._round_prompts[u * per:(u + 1) * per]})
        return metrics

    def anchors(self, rb) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        T = self.cfg.trainer.temperature
        batch = rb.policy_batch()
        old = self.oldlogp.old_logp(rb, self.version)  # oldlogp hook 2/3 (None: anchor on the rollout log-probs)
        if old is not None or self.algorithm.needs_old_logp:
            out["old_logp"] = self._last_stage(old, rb)
        if self.ref is not None:
            out["ref_logp"] = self._last_stage(self.ref.logprobs(batch, T), rb)
        return out

    @staticmethod
    def _last_stage(logp, rb):
        """Log-probs exist on the last PP stage only; other stages get zeros (they never evaluate the loss)."""
        return logp if logp is not None else torch.zeros_like(rb.rollout_logp)

    def prox_logp(self, rb) -> torch.Tensor:
        params = list(self.policy.model.parameters())
        with self.ewma.swapped_in(params):
            logp = self.policy.logprobs(rb.policy_batch(), self.cfg.trainer.temperature)
        return self._last_stage(logp, rb)

    def sync_weights(self, bump: bool = True) -> dict[str, float]:
        if not self.cfg.trainer.sync_weights:
            return {}
        if bump:
            self.version += 1
        rc = self.cfg.rollout
        opts = SyncOptions(sync_dir=rc.sync_dir, config_dir=self.model_dir, keep_versions=rc.keep_versions,
                           bucket_mb=getattr(rc, "bucket_mb", 512.0))  # bucket_mb: SGLang tensor/nccl payloads only
        out = sync_weights(self.policy, self.engine, self.version, mode=rc.sync_mode, options=opts)
        if bump:  # oldlogp hook 3/3: a new version, after the engine holds it
            self.oldlogp.on_version(self.version, self._finished_samples if self.rank == 0 else None)
        return out

    def log(self, metrics: dict[str, float]) -> None:
        if self.rank != 0:
            return
        metrics.update(memory_gb())
        self.logger.log(self.update, metrics)
        if self.cfg.logging.progress:
            if self._progress is None:
                from tqdm import tqdm

                self._progress = tqdm(total=self.cfg.trainer.steps, initial=self.update - 1, desc="updates",
                                      dynamic_ncols=True)
            self._progress.update(self.update - self._progress.n)
            post = {"reward": f"{metrics.get('reward_mean', 0):.3f}"}
            if self._last_heldout is not None:
                post["heldout"] = f"{self._last_heldout:.3f}"
            if "tokens_per_s" in metrics:  # set on a round's last record only: never a partial-round rate
                post["tok/s"] = f"{metrics['tokens_per_s']:.0f}"
            self._progress.set_postfix(post)

    def maybe_evaluate(self, force: bool = False) -> None:
        """Held-out eval before the first update, every `eval.every` updates, and at the end (once per update)."""
        e = self.cfg.eval
        if e.num_prompts <= 0 or self.last_eval == self.update:
            return
        if not force and (e.every <= 0 or self.update < self.next_eval):
            return
        self.last_eval = self.update
        if self.rank == 0:
            t0, c0 = time.perf_counter(), time.process_time()
            m = evaluate_sets(self.engine, self.reward_fn, self.data.eval_sets(self.reward_fn), e.samples_per_prompt,
                              e.temperature, e.max_new_tokens, e.seed, self.data.stop_token_ids)
            m["time_eval"] = time.perf_counter() - t0
            self.compute.add_eval_time(m["time_eval"], time.process_time() - c0)
            m.update(self.compute.record())
            self._last_heldout = m["mean_at_k"]
            self.logger.log(self.update, m, kind="eval")
            with (self.run_dir / "eval_prompts.jsonl").open("a") as f:  # the lists the metrics logger drops
                f.write(json.dumps({"step": self.update, **{k: v for k, v in m.items() if isinstance(v, list)}})
                        + "\n")
            log.warning("eval @ update %d: mean@%d=%.3f pass@%d=%.3f", self.update, e.samples_per_prompt,
                        m["mean_at_k"], e.samples_per_prompt, m["pass_at_k"])
        if e.every > 0:
            while self.next_eval <= self.update:
                self.next_eval += e.every

    def checkpoint(self) -> Path:
        return checkpoint(self)

    def maybe_checkpoint(self) -> None:
        every = self.cfg.trainer.save_every
        crossed = every > 0 and (self.update // every) > ((self.update - self.schedule.updates_per_round) // every)
        if crossed or self.stop.agreed():
            self.checkpoint()

    def finish(self) -> None:
        preempted = self.stop.agreed()
        if preempted:
            if not latest_checkpoint(self.ckpt_root) or latest_update(self.ckpt_root) != self.update:
                self.checkpoint()
            if self.rank == 0:
                (self.run_dir / "PREEMPTED").write_text(json.dumps({"update": self.update,
                                                                    "signals": self.stop.signals}))
        else:
            if self.update > 0 and latest_update(self.ckpt_root) != self.update:
                self.checkpoint()
            self.maybe_evaluate(force=True)
            if self.cfg.trainer.export_hf:
                self.export_hf()
        if self.rank == 0:
            self.schedule.close()  # async rounds generated ahead that no update will consume
            self.prompts_log.close()
            if self._progress is not None:
                self._progress.close()
            self.logger.close()
            if self.cfg.logging.plot:
                plot_run(self.run_dir)
            from mcore_rl.evaluation.summary import run_summary

            print(run_summary(self.run_dir), flush=True)
            if self.reward_fn is not None:
                self.reward_fn.close()
            if self.engine is not None:
                self.engine.close()

    def export_hf(self) -> None:
        from mcore_rl.rollout.weight_sync.disk_sync import write_hf_folder

        stream = self.policy.hf_tensors(dst=0)
        if self.rank == 0:
            write_hf_folder(stream, self.run_dir / "hf", config_dir=self.model_dir, overwrite=True)
        else:
            for _ in stream:
                pass
