"""async (PipelineRL-k): k = `max_staleness` rounds are generated ahead while the trainer trains on the oldest.

Free-running (trainer.deterministic=false): weight updates land in the engine mid-generation, so a sample's tokens
can span versions (each token records its own). Which version produces which token then depends on timing: two
runs with the same seed differ. Deterministic (trainer.deterministic=true): the weight sync first waits until the
rounds in flight have finished, and new rounds are submitted to an idle engine in one call. Every round is then
generated entirely by the version current at its submission (exactly k versions behind when consumed), the
engine's batches are the same in every run, and a resumed run reproduces the uninterrupted one. Generation still
overlaps training: round r + k generates while the trainer trains on round r.

Staleness is checked, not assumed: when a round is consumed, a group whose oldest token lags the trainer's version
by more than `max_staleness` is dropped or, with `stale_policy=requeue`, its prompt is generated again in the next
submitted round. Both are counted in the metrics.
"""

from __future__ import annotations

from mcore_rl.trainer.schedule.base import SCHEDULES, Generated, Schedule, ScheduleContext, _Round


def staleness(version: int, samples) -> int:
    """Versions the oldest policy token of `samples` lags `version` (0 when nothing was generated); tool and
    environment tokens of an episode carry version -1 and are not the policy's."""
    oldest = min((v for s in samples for v in s.weight_versions if v >= 0), default=version)
    return version - oldest


@SCHEDULES.register("async")
class AsyncSchedule(Schedule):
    name = "async"
    def __init__(self, ctx: ScheduleContext) -> None:
        super().__init__(ctx)
        c = ctx.algorithm
        self.depth = c.max_staleness
        self.max_staleness = c.max_staleness
        self.policy = c.stale_policy
        self.totals = {"stale_dropped_total": 0.0, "stale_requeued_total": 0.0}

    def before_sync(self) -> None:
        if self.deterministic and self.engine is not None:
            self._wait(self._all_futures())

    def _accept(self, rnd: _Round) -> Generated:
        version = self.state.version
        fresh, lags = [], []
        for r in rnd.requests:
            lag = staleness(version, r.result())
            lags.append(lag)
            if lag <= self.max_staleness:
                fresh.append(r)
            elif self.policy == "requeue":
                self.requeued.append(r.prompt)
        n_stale = len(rnd.requests) - len(fresh)
        key = "stale_requeued_total" if self.policy == "requeue" else "stale_dropped_total"
        self.totals[key] += n_stale
        metrics = {"stale_groups": float(n_stale), "staleness_checked_max": float(max(lags, default=0)),
                   "inflight_rounds": float(len(self.pending)), **self.totals}
        return Generated(rnd.index, [r.prompt for r in fresh], [s for r in fresh for s in r.result()], metrics)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "totals": dict(self.totals)}

    def load_state_dict(self, state: dict) -> None:
        self.totals.update(state.get("totals") or {})
        super().load_state_dict(state)
