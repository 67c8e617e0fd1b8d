"""Rank 0's prompt supply: training prompts (seeded, resumable), the fixed held-out set(s), pass-rate retirement."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcore_rl.config import EvalConfig
from mcore_rl.data import PromptSampler, build_dataset, render_prompt
from mcore_rl.trainer.setup import ConfigError

log = logging.getLogger("mcore_rl")


@dataclass
class Prompt:
    prompt_id: str
    prompt_ids: list[int]
    answer: str


def _dataset(spec: dict, where: str):
    try:
        ds = build_dataset(spec)
    except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
        raise ConfigError(f"{where}: {str(e).strip(chr(39))}") from None
    if ds.summary.num_skipped:
        log.warning("%s: %s", where, ds.summary.line())
    return ds


class PromptSource:
    """`data`: the data group (its kind's loader types and checks it); `retire_pass_rate`: the algorithm's
    ScaleRL prompt retirement threshold (None: off)."""

    def __init__(self, data: dict[str, Any], evaluation: EvalConfig, model_dir: Path, seed: int,
                 prompts_per_update: int, max_new_tokens: int, retire_pass_rate: float | None = None) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self._cache: dict[str, list[int]] = {}
        self._by_id: dict | None = None
        spec = dict(data)
        sampler_cfg = spec.get("sampler") or {}
        self.train = _dataset(spec, "data")
        self.train = self._drop_overlong(self.train, model_dir, max_new_tokens, "data")
        self.per_update = prompts_per_update
        self.history = None
        if retire_pass_rate:
            from mcore_rl.algorithms import PassRateHistory

            self.history = PassRateHistory(threshold=retire_pass_rate)
        self.sampler = PromptSampler(self.train, batch_size=self.per_update, seed=sampler_cfg.get("seed", seed),
                                     shuffle=sampler_cfg.get("shuffle", True),
                                     skip=self.history.is_retired if self.history else None)
        self.model_dir, self.eval_max_new_tokens = model_dir, evaluation.max_new_tokens
        self.eval_spec = self._eval_spec(evaluation, spec)
        self._eval: list[Prompt] | None = None
        self.eval_num_prompts = int(evaluation.num_prompts)
        self.eval_set_specs = self._eval_set_specs(evaluation)
        self._eval_sets: list | None = None
        self.stop_token_ids = [t for t in {self.tokenizer.eos_token_id} if t is not None]

    def _drop_overlong(self, ds, model_dir: Path, max_new_tokens: int, where: str):
        """Rows the engine would reject (prompt + max_new_tokens > context) are counted and skipped at load."""
        import json

        from mcore_rl.data.filters import drop_overlong

        context = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
        if not context:
            return ds
        before = ds.summary.num_skipped
        try:
            ds = drop_overlong(ds, lambda r: len(self._render(r).prompt_ids), max_new_tokens, int(context))
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
        if ds.summary.num_skipped > before:
            log.warning("%s: %s", where, ds.summary.line())
        return ds

    @staticmethod
    def _eval_spec(evaluation: EvalConfig, train_spec: dict) -> dict | None:
        if evaluation.num_prompts <= 0:
            return None
        if evaluation.data:
            return dict(evaluation.data)
        spec = dict(train_spec)  # same kind; generators get a different seed so the set is fixed and separate
        if "seed" in spec:
            spec["seed"] = int(spec["seed"]) + 1000
        if "size" in spec:
            spec["size"] = evaluation.num_prompts
        return spec

    @staticmethod
    def _eval_set_specs(evaluation: EvalConfig) -> list[str]:
        """`eval.sets`: `mcore-rl-eval --set` specs, checked here (one line naming the entry) before any model loads."""
        from mcore_rl.evaluation.sets import parse_spec

        specs = list(evaluation.sets or [])
        if specs and evaluation.data:
            raise ConfigError("eval.sets and eval.data are both set: name the held-out sets in one of them")
        for i, spec in enumerate(specs):
            if not isinstance(spec, str) or not spec.strip():
                raise ConfigError(f"eval.sets[{i}]: expected a set spec string like 'arithmetic' or "
                                  f"'reasoning_gym/gcd', got {spec!r}")
            try:
                parse_spec(spec, int(evaluation.num_prompts))
            except ValueError as e:
                raise ConfigError(f"eval.sets[{i}]: {e}") from None
        return specs

    def eval_sets(self, reward_fn=None) -> list:
        """The held-out sets to evaluate: `eval.sets` loaded with mcore-rl-eval's loader and scorers (math_verify
        scoring borrows the trainer's reward), or the single default set (scored by the trainer's reward, metrics
        unprefixed)."""
        from mcore_rl.evaluation.runner import HeldOutSet

        if self._eval_sets is not None:
            return self._eval_sets
        if not self.eval_set_specs:
            prompts = self.eval_prompts()
            self._eval_sets = [HeldOutSet("heldout", [p.prompt_ids for p in prompts], prompts, prefixed=False)]
            return self._eval_sets
        import json

        from mcore_rl.data import render_prompt
        from mcore_rl.evaluation.sets import load_set, set_name

        context = json.loads((Path(self.model_dir) / "config.json").read_text()).get("max_position_embeddings")
        out, names = [], set()
        for i, spec in enumerate(self.eval_set_specs):
            try:
                es = load_set(spec, self.eval_num_prompts, reward=reward_fn)
            except ValueError as e:
                raise ConfigError(f"eval.sets[{i}]: {e}") from None
            rows = [(r, render_prompt(self.tokenizer, r)) for r in es.records]
            kept = [(r, ids) for r, ids in rows if not context or len(ids) + self.eval_max_new_tokens <= context]
            if len(kept) < len(rows):
                log.warning("eval.sets[%d] %s: %d prompt(s) longer than the context minus eval.max_new_tokens "
                            "skipped", i, spec, len(rows) - len(kept))
            if not kept:
                raise ConfigError(f"eval.sets[{i}] {spec}: no prompt fits the context with eval.max_new_tokens")
            name = base = set_name(spec)
            while name in names:
                name = f"{base}_{len(names)}"
            names.add(name)
            out.append(HeldOutSet(name, [ids for _, ids in kept], [r for r, _ in kept], scorer=es.scorer))
        self._eval_sets = out
        return out

    def heldout(self, engine: Any, reward_fn: Any, e: EvalConfig) -> dict[str, Any]:
        """The trainer's periodic evaluation of the held-out set(s) (evaluation/runner.py: evaluate_sets)."""
        from mcore_rl.evaluation.runner import evaluate_sets

        return evaluate_sets(engine, reward_fn, self.eval_sets(reward_fn), e.samples_per_prompt, e.temperature,
                             e.max_new_tokens, e.seed, self.stop_token_ids)  # fmt: skip

    def _render(self, rec) -> Prompt:
        ids = self._cache.get(rec.prompt_id)
        if ids is None:
            ids = self._cache[rec.prompt_id] = render_prompt(self.tokenizer, rec)
        return Prompt(rec.prompt_id, ids, rec.answer)

    def next_prompts(self, n: int) -> list[Prompt]:
        if n % self.per_update:
            raise ValueError(f"asked for {n} prompts, not a multiple of trainer.prompts_per_update={self.per_update}")
        return [self._render(r) for _ in range(n // self.per_update) for r in self.sampler.next_batch()]

    def lookup(self, prompt_id: str) -> Prompt:
        """A training prompt by id: a resumed run regenerates the prompts that were in flight at the checkpoint."""
        if self._by_id is None:
            self._by_id = {r.prompt_id: r for r in self.train}
        rec = self._by_id.get(prompt_id)
        if rec is None:
            raise ConfigError(f"checkpoint: prompt {prompt_id!r} was in flight but is not in the training data "
                              "(was data changed between the run and its resume?)")
        return self._render(rec)

    def eval_prompts(self) -> list[Prompt]:
        if self._eval is None:
            ds = _dataset(self.eval_spec, "eval.data") if self.eval_spec else []
            if ds:
                ds = self._drop_overlong(ds, self.model_dir, self.eval_max_new_tokens, "eval.data")
            self._eval = [self._render(r) for r in list(ds)[: len(ds)]]
        return self._eval

    def observe(self, prompt_ids: list[str], rewards: list[float]) -> None:
        if self.history is not None:
            import torch

            self.history.update(prompt_ids, torch.tensor(rewards))

    def metrics(self) -> dict[str, float]:
        m = {"data_epoch": float(self.sampler.epoch), "data_rows_skipped": float(self.train.summary.num_skipped)}
        if self.history is not None:
            m.update({f"pass_rate_{k}": float(v) for k, v in self.history.metrics().items()})
        return m

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict(),
                "history": self.history.state_dict() if self.history is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        if self.history is not None and state.get("history"):
            self.history.load_state_dict(state["history"])
