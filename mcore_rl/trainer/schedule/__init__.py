"""Schedules: when generation is submitted, what happens around training, how many updates a round serves.

One small module each (sync, staged, async), registered by name in `SCHEDULES` (imported when first named);
`algorithm.schedule` (or the `schedule` config group) picks one. The loop in trainer/loop.py calls the same
methods whatever the schedule, so it has no schedule `if`.
"""

from mcore_rl.trainer.schedule.base import SCHEDULES, Generated, Schedule, ScheduleContext, schedule_class

__all__ = ["SCHEDULES", "Generated", "Schedule", "ScheduleContext", "schedule_class"]
