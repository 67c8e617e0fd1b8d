"""Training on environment episodes (`env=NAME`): the environment's prompts, episodes in place of generations.

Why episodes enter here and nowhere else: a round is still a list of requests, one per prompt, with
`samples_per_prompt` futures each. With an environment, each of those futures resolves to one whole episode
(EpisodeRunner) packed into a single trainer Sample (envs.batch.trajectory_sample): the first prompt, then every
later token with `output_mask` 0 on tool / environment text, per-token log-probs and weight versions, the episode's
reward in its metadata. The schedules (sync, staged, async), their checkpoints and exact resume, the old-log-prob
sources and the batch builder therefore handle episodes without a branch of their own; only scoring (the reward is
the environment's) and held-out evaluation (evaluation/envs.py) differ.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcore_rl.config import EvalConfig
from mcore_rl.data import PromptSampler
from mcore_rl.data.records import PromptRecord
from mcore_rl.rollout.protocol import GenerationRequest, RolloutEngine, Sample, SamplingParams
from mcore_rl.trainer.prompts import Prompt
from mcore_rl.trainer.setup import ConfigError

log = logging.getLogger("mcore_rl")


@dataclass
class EpisodePrompt(Prompt):
    """A training prompt that starts an episode: the record the environment judges against."""

    record: PromptRecord | None = None


def build_env(spec: dict[str, Any]) -> Any:
    """The environment of `env=NAME` (its keys checked one by one); a bad key is a one-line config error."""
    from mcore_rl.envs import build_environment

    try:
        return build_environment(spec)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(str(e).strip("'\"")) from None


class EnvPromptSource:
    """The prompt supply of an environment run (rank 0): the env's train split through the seeded, resumable
    PromptSampler, its held-out split for evaluation. Same interface as trainer.prompts.PromptSource."""

    def __init__(self, env_spec: dict[str, Any], evaluation: EvalConfig, model_dir: Path, seed: int,
                 prompts_per_update: int, retire_pass_rate: float | None = None) -> None:  # fmt: skip
        from transformers import AutoTokenizer

        from mcore_rl.envs.chat import TurnRenderer

        self.env = build_env(env_spec)
        self.env_spec = dict(env_spec)
        try:
            self.train = list(self.env.records("train"))
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"env={self.env.name!r}: {str(e).strip(chr(39))}") from None
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        try:
            self.renderer = TurnRenderer(self.tokenizer, [t.schema() for t in self.env.tools])
        except ValueError as e:
            raise ConfigError(f"env={self.env.name!r} with model {model_dir}: {e}") from None
        self.per_update, self.evaluation = prompts_per_update, evaluation
        self.history = None
        if retire_pass_rate:  # ScaleRL: a prompt whose episodes keep succeeding is retired, as for `data`
            from mcore_rl.algorithms import PassRateHistory

            self.history = PassRateHistory(threshold=retire_pass_rate)
        self.sampler = PromptSampler(self.train, batch_size=prompts_per_update, seed=seed,
                                     skip=self.history.is_retired if self.history else None)  # fmt: skip
        self._by_id = {r.prompt_id: r for r in self.train}
        self.stop_token_ids = [t for t in {self.tokenizer.eos_token_id} if t is not None]

    def _prompt(self, rec: PromptRecord) -> EpisodePrompt:
        ids = self.renderer.prompt_ids(self.env.start(rec))
        return EpisodePrompt(rec.prompt_id, ids, rec.answer, record=rec)

    def next_prompts(self, n: int) -> list[EpisodePrompt]:
        if n % self.per_update:
            raise ValueError(
                f"asked for {n} prompts, not a multiple of trainer.prompts_per_update={self.per_update}"
            )
        return [self._prompt(r) for _ in range(n // self.per_update) for r in self.sampler.next_batch()]

    def lookup(self, prompt_id: str) -> EpisodePrompt:
        rec = self._by_id.get(prompt_id)
        if rec is None:
            raise ConfigError(
                f"checkpoint: prompt {prompt_id!r} was in flight but is not in env "
                f"{self.env.name!r}'s training records (was env changed before the resume?)"
            )
        return self._prompt(rec)

    def observe(self, prompt_ids: list[str], rewards: list[float]) -> None:
        if self.history is not None:
            import torch

            self.history.update(prompt_ids, torch.tensor(rewards))

    def metrics(self) -> dict[str, float]:
        m = {"data_epoch": float(self.sampler.epoch)}
        if self.history is not None:
            m.update({f"pass_rate_{k}": float(v) for k, v in self.history.metrics().items()})
        return m

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict(),
                "history": self.history.state_dict() if self.history is not None else None}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        if self.history is not None and state.get("history"):
            self.history.load_state_dict(state["history"])

    def heldout(self, engine: RolloutEngine, reward_fn: Any, e: EvalConfig) -> dict[str, Any]:
        """The environment's held-out episodes through mcore-rl-eval --env's evaluate_env: success as mean@k /
        pass@k (the keys the trainer's progress and summaries read) plus the episode metrics under `env/`."""
        from mcore_rl.evaluation.envs import EnvSet, evaluate_env
        from mcore_rl.evaluation.runner import GenerationConfig

        records = self.env.records("heldout")[: e.num_prompts]
        if not records:
            return {}
        gen = GenerationConfig(n=e.samples_per_prompt, temperature=e.temperature, seed=e.seed)
        res = evaluate_env(engine, self.tokenizer, EnvSet(self.env.name, self.env, list(records), self.env_spec),
                           gen, self.stop_token_ids, ks=[e.samples_per_prompt])  # fmt: skip
        s, k = res.summary, e.samples_per_prompt
        skip = {"n", "num_prompts", "mean_at_n", "response_len", "truncation_rate", "time_generate_s",
                "time_total_s", "tokens_per_s"}  # fmt: skip
        return {
            "mean_at_k": s["mean_at_n"],
            "pass_at_k": s[f"pass_at_{k}"],
            "k": float(k),
            "num_prompts": s["num_prompts"],
            "response_len": s["response_len"],
            "truncation_rate": s["truncation_rate"],
            "per_prompt_correct": res.correct.mean(1).tolist(),
            **{f"env/{key}": v for key, v in s.items() if key not in skip and not key.startswith("pass_at_")},
        }

    def close(self) -> None:
        self.env.close()


class EpisodeLauncher:
    """`submit(requests)` like an engine's, but each of a request's n futures is a whole episode (a Sample with
    `output_mask`). Each request's episodes run in a pool thread through one shared EpisodeRunner (its state is per
    call; its tool pool is one, warm, its batches taken one at a time); every turn goes to the real engine, so the
    engine batches the turns of all live episodes together."""

    def __init__(self, source: EnvPromptSource, engine: RolloutEngine, max_workers: int = 64) -> None:
        from mcore_rl.envs.runner import EpisodeRunner

        self.source, self.engine = source, engine
        self.turns = _TurnLog(engine)  # what the episode runner submits goes through it
        self.runner = EpisodeRunner(source.env, self.turns, source.renderer)
        if self.runner.tools is not None:
            self.runner.tools = _Serialized(self.runner.tools)
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="episodes")

    def submit(self, requests: Sequence[GenerationRequest], prompts: Sequence[EpisodePrompt]) -> list[Future]:
        out: list[Future] = []
        for req, prompt in zip(requests, prompts, strict=True):
            parent = self.pool.submit(self._episodes, req, prompt)
            out.extend(_child(parent, j) for j in range(req.sampling.n))
        return out

    def _episodes(self, req: GenerationRequest, prompt: EpisodePrompt) -> list[Sample]:
        from mcore_rl.envs.batch import trajectory_sample

        sp = req.sampling
        sampling = SamplingParams(temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed,
                                  stop_token_ids=list(sp.stop_token_ids))  # fmt: skip
        trajs = self.runner.run([prompt.record], sampling, samples_per_prompt=sp.n)
        return [trajectory_sample(t, rid=req.rid) for t in trajs]

    def finished_turns(self) -> list[Sample]:
        """The model turns finished so far, each as a Sample whose prompt is the episode up to it (the old-log-prob
        source `old_logit_model` scores them at their version before the next one loads)."""
        return self.turns.recent()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.runner.tools is not None:
            self.runner.tools.close()


class _Serialized:
    """A ToolRunner shared by the episode threads: one pool batch at a time."""

    def __init__(self, tools: Any) -> None:
        self.tools, self._lock = tools, threading.Lock()

    def run(self, calls: Sequence[Any]) -> list[Any]:
        with self._lock:
            return self.tools.run(calls)

    def __getattr__(self, name: str) -> Any:  # close, refused, stats: the runner's own
        return getattr(self.tools, name)


class _TurnLog:
    """The engine as the episode runners see it, writing down every finished turn the moment the engine resolves
    it (in the thread that ran the engine's step, so before a later weight version can be announced). Turns more
    than one version older than the newest are forgotten: a version hook only asks for the version it is leaving."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine, self._lock, self._turns, self._newest = engine, threading.Lock(), [], -1

    def submit(self, requests: Sequence[GenerationRequest]) -> list[Future]:
        futures = self.engine.submit(requests)
        for f in futures:
            f.add_done_callback(self._record)
        return futures

    def _record(self, f: Future) -> None:
        if f.cancelled() or f.exception() is not None:
            return
        s = f.result()
        if s.finish_reason == "abort" or not s.output_ids:
            return
        v = max(s.weight_versions)
        with self._lock:
            self._newest = max(self._newest, v)
            self._turns = [t for t in self._turns if max(t.weight_versions) >= self._newest - 1] + [s]

    def recent(self) -> list[Sample]:
        with self._lock:
            return list(self._turns)

    def __getattr__(self, name: str) -> Any:  # abort, pause, ... : the engine's own
        return getattr(self.engine, name)


def _child(parent: Future, j: int) -> Future:
    """Sample j of the request's episodes, resolved when the parent (all n episodes of the prompt) is."""
    child: Future = Future()
    child.set_running_or_notify_cancel()

    def done(f: Future) -> None:
        if f.cancelled():
            child.set_exception(CancelledError())
        elif f.exception() is not None:
            child.set_exception(f.exception())
        else:
            child.set_result(f.result()[j])

    parent.add_done_callback(done)
    return child
