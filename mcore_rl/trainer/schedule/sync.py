"""sync (GRPO family): generate a round, then `updates_per_rollout` optimizer updates on it, then sync weights."""

from __future__ import annotations

from mcore_rl.trainer.schedule.base import SCHEDULES, Schedule


@SCHEDULES.register("sync")
class SyncSchedule(Schedule):
    name = "sync"
    depth = 0
