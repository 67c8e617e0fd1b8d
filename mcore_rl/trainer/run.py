"""A run's components and the per-phase operations the loop calls. Rank 0 owns the engine, data and rewards;
every rank owns its policy shard. Samples travel from rank 0 to all ranks by broadcast."""

from __future__ import annotations

import copy
import json
import logging
import time
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from mcore_rl.agreement import FatalRunError
from mcore_rl.algorithms import build_algorithm
from mcore_rl.distributed import init_distributed
from mcore_rl.logging import MetricsLogger, memory_gb, plot_run
from mcore_rl.policy.policy import Policy
from mcore_rl.rewards.base import failure_counts
from mcore_rl.rollout.protocol import GenerationRequest, SamplingParams
from mcore_rl.rollout.weight_sync.megatron_sync import sync_weights
from mcore_rl.rollout.weight_sync.transports import TRAINER_KEYS, SyncOptions
from mcore_rl.trainer import prompts as prompt_src
from mcore_rl.trainer.evaluate import evaluate_sets
from mcore_rl.trainer.rollout_batch import build_rollout_batch
from mcore_rl.trainer.setup import (
    StopFlag,
    check_model_against_parallel,
    policy_config,
    resolve_model_dir,
    validate_config,
)
from mcore_rl.trainer.state import latest_checkpoint, load_checkpoint, save_checkpoint, sweep_stale
from mcore_rl.trainer.update import NonFiniteGuard

log = logging.getLogger("mcore_rl")


def _broadcast(obj):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Run:
    def __init__(self, cfg: DictConfig):
        validate_config(cfg)  # one-line errors before anything heavy
        self.cfg = cfg
        if cfg.trainer.deterministic:
            torch.set_num_threads(max(1, torch.get_num_threads()))
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.model_dir = resolve_model_dir(cfg)
        check_model_against_parallel(cfg, self.model_dir)
        layout = init_distributed(cfg.parallel.tp, cfg.parallel.pp, seed=cfg.seed, ep=cfg.parallel.get("ep", 1))
        self.rank, self.dp = layout.rank, layout.dp
        from megatron.core import parallel_state as ps

        self.dp_rank = ps.get_data_parallel_rank()
        self.run_dir = Path(_broadcast(str(Path(cfg.run.dir).resolve())))
        self.algorithm = build_algorithm(OmegaConf.to_container(cfg.algorithm, resolve=True))
        ac = self.algorithm.config
        self.staged = ac.schedule == "staged"
        # async (PipelineRL-k): rank 0 keeps k rounds of generation in flight while the trainer trains; weight
        # updates land mid-generation and every token records the version that produced it
        self.async_k = max(1, ac.max_staleness) if ac.schedule == "async" else 0
        self._pending: deque = deque()
        self.updates_per_round = ac.updates_per_stage if self.staged else ac.updates_per_rollout
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
            if self.staged and isinstance(rc.get("launcher"), dict):  # SGLang releases memory only with a saver
                rc["launcher"]["memory_saver"] = True
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
        self.last_eval: int | None = None
        self._progress = None
        self._last_heldout: float | None = None
        self.compute = None
        if self.rank == 0:  # FLOPs / wall-clock accounting, written with every eval record
            from mcore_rl.evaluation.compute import ComputeMeter, model_flops

            self.compute = ComputeMeter(model_flops(self.model_dir), dist.get_world_size() if dist.is_initialized()
                                        else 1, torch.cuda.is_available())
        self._resume_or_start()

    # ---- setup helpers -----------------------------------------------------------------------------------
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

        lc = LoadCheckConfig(**(self.cfg.model.get("load_check") or {}))
        res = run_load_check(self.policy, self.model_dir, lc, from_hf=not self.cfg.model.mcore_ckpt)
        log.warning(res.line(lc.tol))
        if res.ran and not res.max_abs_diff <= lc.tol:
            raise ConfigError(f"{res.line(lc.tol)}: the {self.policy.args.architecture} adapter's weight mapping "
                              f"does not reproduce {self.model_dir}; refusing to train")

    @property
    def ckpt_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def _resume_or_start(self) -> None:
        if self.rank == 0:
            sweep_stale(self.ckpt_root)
        ckpt = latest_checkpoint(self.ckpt_root, report=True) if self.cfg.trainer.resume == "auto" else None
        need_sync = bool(self.cfg.model.mcore_ckpt)
        if ckpt is not None:
            meta, extra = load_checkpoint(ckpt, self.policy)
            t = meta["trainer"]
            self.update, self.round, self.version, self.next_eval = t["update"], t["round"], t["version"], t[
                "next_eval"]
            if self.ewma is not None and "ewma" in extra:
                self.ewma.load_state_dict(extra["ewma"])
            if self.rank == 0:
                self.data.load_state_dict(t["data"])
            if t.get("algorithm") is not None:
                self.algorithm.load_state_dict(t["algorithm"])
            if self.compute is not None and t.get("compute"):
                self.compute.load_state_dict(t["compute"])
            log.warning("resumed from %s at update %d", ckpt, self.update)
            need_sync = True
        if need_sync:
            self.sync_weights(bump=False)
        if self.rank == 0:
            (self.run_dir / "PREEMPTED").unlink(missing_ok=True)
            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(self.cfg, resolve=True))

    # ---- phases --------------------------------------------------------------------------------------------
    def engine_call(self, name: str) -> None:
        if self.engine is not None:
            getattr(self.engine, name)()

    def _requests(self, num_updates: int, round_index: int):
        t = self.cfg.trainer
        prompts = self.data.next_prompts(num_updates * t.prompts_per_update)
        base = (self.cfg.seed * 1_000_003 + round_index) * 10_007
        reqs = [GenerationRequest(prompt_ids=p.prompt_ids, rid=f"r{round_index}-{i}", sampling=SamplingParams(
            max_new_tokens=t.max_new_tokens, temperature=t.temperature, top_p=t.top_p,
            n=t.samples_per_prompt, seed=base + i, stop_token_ids=self.data.stop_token_ids))
            for i, p in enumerate(prompts)]
        return reqs, prompts

    def generate(self, num_updates: int):
        """Rank 0 samples `num_updates * prompts_per_update` prompts x G; all ranks get (samples, prompts).

        A stop signal (Slurm preemption) that lands during generation aborts the in-flight requests and drops
        the partial round: every rank gets None, the data cursor goes back to where the round began (the
        resumed run regenerates it), and the loop checkpoints at once instead of waiting for a long round.
        """
        payload = None
        if self.rank == 0:
            if not self.async_k:
                self._pending.append(self._submit(num_updates, self.round))
            else:
                submitted = self.round + len(self._pending)
                while len(self._pending) < self.async_k + 1:
                    self._pending.append(self._submit(num_updates, submitted))
                    submitted += 1
            futures, prompts, _ = self._pending[0]
            samples = self._wait_or_stop(futures)
            if samples is not None:
                self._pending.popleft()
                payload = (samples, prompts)
            else:
                self._drop_pending()
        payload = _broadcast(payload)
        if payload is not None:
            self.round += 1
        return payload

    def _submit(self, num_updates: int, round_index: int):
        data_state = copy.deepcopy(self.data.state_dict())  # where this round's prompts begin, for a dropped round
        reqs, prompts = self._requests(num_updates, round_index)
        return self.engine.submit(reqs), prompts, data_state

    def _wait_or_stop(self, futures, poll_s: float = 0.2):
        """The round's samples, or None when a stop signal arrived first (in-flight requests aborted)."""
        from concurrent.futures import wait

        pending = set(futures)
        while pending:
            if self.stop.requested:
                return None
            _, pending = wait(pending, timeout=poll_s)
        return [f.result() for f in futures]

    def _drop_pending(self) -> None:
        """Abort every round in flight and rewind the data cursor to the oldest one's start."""
        self.engine.abort(None)
        self.data.load_state_dict(self._pending[0][2])
        log.warning("stop requested during generation: aborted round %d (%d round(s) in flight)", self.round,
                    len(self._pending))
        self._pending.clear()

    def score(self, samples, prompts):
        G = self.cfg.trainer.samples_per_prompt
        payload = failures = None
        if self.rank == 0:
            answers = [p.answer for p in prompts for _ in range(G)]
            try:
                results = self.reward_fn.score([s.text or "" for s in samples], answers)
            except FatalRunError as e:  # every rank must stop, not wait in the broadcast below
                payload = str(e)
            else:
                payload = ([r.score for r in results], [bool(r.correct) for r in results])
                failures = failure_counts(results)
                self.data.observe([p.prompt_id for p in prompts for _ in range(G)], payload[0])
                score_passes = (int(self.algorithm.needs_old_logp) + int(self.ref is not None)
                                + int(self.ewma is not None))
                self.compute.add_round([(len(s.prompt_ids), len(s.output_ids)) for s in samples], score_passes)
        payload = _broadcast(payload)
        if isinstance(payload, str):
            raise FatalRunError(payload)
        rewards, correct = payload
        group_ids = [i // G for i in range(len(samples))]
        rb = build_rollout_batch(samples, rewards, correct, group_ids, pad_id=0)
        lengths = rb.response_len
        metrics = {
            "reward_mean": rb.rewards.mean().item(), "reward_std": rb.rewards.std().item() if len(rb) > 1 else 0.0,
            "accuracy": rb.correct.mean().item(), "response_len": lengths.mean().item(),
            "response_len_max": lengths.max().item(), "truncation_rate": rb.truncated.mean().item(),
            "rollout_tokens": lengths.sum().item(), "weight_version": float(self.version),
            "staleness_max": float(self.version - rb.versions[rb.loss_mask > 0].min().item())
            if rb.loss_mask.sum() > 0 else 0.0,
        }
        if self.rank == 0:
            metrics.update(self.data.metrics())
            metrics.update(failures)
            if hasattr(self.engine, "fault_metrics"):  # SGLang: HTTP retries, stale samples dropped, restarts
                metrics.update(self.engine.fault_metrics())
        return rb, metrics

    def anchors(self, rb) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        T = self.cfg.trainer.temperature
        batch = rb.policy_batch()
        if self.algorithm.needs_old_logp:
            out["old_logp"] = self._last_stage(self.policy.logprobs(batch, T), rb)
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
        opts = SyncOptions(sync_dir=rc.get("sync_dir"), config_dir=self.model_dir,
                           keep_versions=rc.get("keep_versions", 2), bucket_mb=rc.get("bucket_mb", 512.0))
        return sync_weights(self.policy, self.engine, self.version, mode=rc.get("sync_mode", "tensor") or "tensor",
                            options=opts)

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
            log.warning("eval @ update %d: mean@%d=%.3f pass@%d=%.3f", self.update, e.samples_per_prompt,
                        m["mean_at_k"], e.samples_per_prompt, m["pass_at_k"])
        if e.every > 0:
            while self.next_eval <= self.update:
                self.next_eval += e.every

    def _trainer_state(self) -> dict:
        st = {"update": self.update, "round": self.round, "version": self.version, "next_eval": self.next_eval}
        if self.rank == 0:
            # async rounds generated ahead are regenerated after a resume: the cursor before the oldest one
            st["data"] = self._pending[0][2] if self._pending else self.data.state_dict()
            st["algorithm"] = self.algorithm.state_dict()
            st["compute"] = self.compute.state_dict()
        return st

    def checkpoint(self) -> Path:
        extra = {"ewma": self.ewma.state_dict()} if self.ewma is not None else {}
        return save_checkpoint(self.ckpt_root, self.update, self.policy, _broadcast(self._trainer_state()),
                               rank_extra=extra, keep=self.cfg.trainer.keep_checkpoints)

    def maybe_checkpoint(self) -> None:
        every = self.cfg.trainer.save_every
        crossed = every > 0 and (self.update // every) > ((self.update - self.updates_per_round) // every)
        if crossed or self.stop.agreed():
            self.checkpoint()

    def finish(self) -> None:
        preempted = self.stop.agreed()
        if preempted:
            if not latest_checkpoint(self.ckpt_root) or self._latest_update() != self.update:
                self.checkpoint()
            if self.rank == 0:
                (self.run_dir / "PREEMPTED").write_text(json.dumps({"update": self.update,
                                                                    "signals": self.stop.signals}))
        else:
            if self.update > 0 and self._latest_update() != self.update:
                self.checkpoint()
            self.maybe_evaluate(force=True)
            if self.cfg.trainer.export_hf:
                self.export_hf()
        if self.rank == 0:
            if self._pending:  # async rounds generated ahead that no update will consume
                self.engine.abort(None)
                self._pending.clear()
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

    def _latest_update(self) -> int | None:
        ck = latest_checkpoint(self.ckpt_root)
        return int(ck.name.split("_")[1]) if ck else None

    def export_hf(self) -> None:
        from mcore_rl.rollout.weight_sync.disk_sync import write_hf_folder

        stream = self.policy.hf_tensors(dst=0)
        if self.rank == 0:
            write_hf_folder(stream, self.run_dir / "hf", config_dir=self.model_dir, overwrite=True)
        else:
            for _ in stream:
                pass
