"""When the trainer evaluates on the held-out set(s): before the first update, every `eval.every` updates and at
the end, at most once per update. Generation and scoring run on rank 0 (the engine's rank); the other ranks only
advance the same counters, so every rank agrees on when the next evaluation is due."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from mcore_rl.config import EvalConfig
from mcore_rl.trainer.reward_service import session as rm_session
from mcore_rl.trainer.runlog import RunLog
from mcore_rl.trainer.state import RunState

log = logging.getLogger("mcore_rl")


class Evaluator:
    def __init__(
        self,
        settings: EvalConfig,
        run_dir: Path,
        runlog: RunLog,
        engine: Any = None,
        reward_fn: Any = None,
        data: Any = None,
        compute: Any = None,
        rm_service: Any = None,
    ) -> None:
        self.settings, self.run_dir, self.runlog = settings, run_dir, runlog
        # reward.rm.placement=trainer: the other ranks join its forwards meanwhile
        self.rm_service = rm_service
        self.engine, self.reward_fn, self.data, self.compute = engine, reward_fn, data, compute

    def maybe_run(self, state: RunState, force: bool = False) -> None:
        e = self.settings
        if e.num_prompts <= 0 or state.last_eval == state.update:
            return
        if not force and (e.every <= 0 or state.update < state.next_eval):
            return
        state.last_eval = state.update
        if self.engine is not None:
            with rm_session(self.rm_service):
                self._run(state.update)
        elif self.rm_service is not None:
            self.rm_service.serve()  # trainer/reward_service.py: until rank 0's evaluation is scored
        if e.every > 0:
            while state.next_eval <= state.update:
                state.next_eval += e.every

    def _run(self, update: int) -> None:
        e = self.settings
        t0, c0 = time.perf_counter(), time.process_time()
        m = self.data.heldout(
            self.engine, self.reward_fn, e
        )  # the data's sets, or the environment's episodes
        if not m:
            return
        m["time_eval"] = time.perf_counter() - t0
        self.compute.add_eval_time(m["time_eval"], time.process_time() - c0)
        m.update(self.compute.record())
        self.runlog.log_eval(update, m)
        with (self.run_dir / "eval_prompts.jsonl").open("a") as f:  # the lists the metrics logger drops
            f.write(
                json.dumps({"step": update, **{k: v for k, v in m.items() if isinstance(v, list)}}) + "\n"
            )
        log.warning(
            "eval @ update %d: mean@%d=%.3f pass@%d=%.3f",
            update,
            e.samples_per_prompt,
            m["mean_at_k"],
            e.samples_per_prompt,
            m["pass_at_k"],
        )
