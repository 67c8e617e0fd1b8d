"""Schedules: when generation is submitted, what happens around training, how many updates a round serves.

One small module each (sync, staged, async), registered by name; `algorithm.schedule` (or the `schedule` config
group) picks one. The loop in trainer/loop.py calls the same hooks whatever the schedule, so it has no schedule `if`.
"""

from mcore_rl.trainer.schedule import pipeline, staged, sync  # noqa: F401  (registration)
from mcore_rl.trainer.schedule.base import SCHEDULES, Generated, Schedule, build_schedule, register_schedule

__all__ = ["SCHEDULES", "Generated", "Schedule", "build_schedule", "register_schedule"]
