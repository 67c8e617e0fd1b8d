"""staged (Mu-GRPO): a round is one large stage serving `updates_per_stage` updates; the engine releases its memory
while the trainer runs (with SGLang that needs the launcher's memory saver, switched on here)."""

from __future__ import annotations

from mcore_rl.trainer.schedule.base import SCHEDULES, Schedule


@SCHEDULES.register("staged")
class StagedSchedule(Schedule):
    name = "staged"
    depth = 0

    @property
    def updates_per_round(self) -> int:
        return self.ctx.algorithm.updates_per_stage

    @staticmethod
    def engine_options(options: dict) -> dict:
        if isinstance(options.get("launcher"), dict):  # SGLang releases memory only with a saver
            options["launcher"]["memory_saver"] = True
        return options

    def before_train(self) -> None:
        if self.engine is not None:
            self.engine.release_memory()

    def after_train(self) -> None:
        if self.engine is not None:
            self.engine.resume_memory()
