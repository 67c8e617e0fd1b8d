"""The old-log-prob source contract: where a round's `old_logp` (the behaviour policy's log-probs) comes from.

The trainer calls, on every rank (the scoring forwards are collective):
    src.on_version(version, finished)   # a new weight version exists: after the optimizer steps, once the
                                        # engine holds it (weight sync), and once at start / resume
    src.old_logp(rb, version)           # the round's batch, before its first update: [N, L] or None (= use the
                                        # engine's rollout log-probs)
    src.metrics()                       # per-round metrics (memory, regenerated samples, missing-old-logit error)
`finished` (rank 0 only, else None) lists the samples that have finished but are not consumed yet; sources
that score samples as they complete (old_logit_model) read it, the others ignore it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from mcore_rl.oldlogp.audit import Auditor
from mcore_rl.oldlogp.store import VersionStore

FinishedFn = Callable[[], list[Any]] | None


@dataclass
class SourceContext:
    """What a source needs from the run; built by the trainer (trainer/build.py) once."""

    policy: Any                      # the trainable Policy (live weights = the newest version)
    temperature: float
    staleness: int                   # k: versions a consumed token may lag (0 = on-policy schedules)
    engine: Any = None               # rank 0: the rollout engine; None elsewhere
    make_policy: Callable[[], Any] | None = None  # a fresh forward-only Policy (old_logit_model)
    audit_frac: float = 0.0          # fraction of rows the missing-old-logit error is measured on (0 = off)
    seed: int = 0


class OldLogpSource:
    name: ClassVar[str] = ""
    keeps_versions: ClassVar[bool] = False     # holds a VersionStore of its own (exact per-token-version scoring)
    needs_interrupt: ClassVar[bool] = False    # the engine must restart in-flight samples at each weight update
    exact: ClassVar[bool] = False              # every token scored under the version that generated it
    # its log-probs are the live weights' forward before the round's first update: the update's own forward
    # gives them again when a round has one update (`reusable`)
    from_live_weights: ClassVar[bool] = False

    def __init__(self, ctx: SourceContext) -> None:
        self.ctx = ctx
        self.store: VersionStore | None = None
        if self.keeps_versions or ctx.audit_frac > 0:  # the audit's exact reference needs the versions
            self.store = VersionStore()
        if self.needs_interrupt and ctx.engine is not None:
            if not hasattr(ctx.engine, "set_interrupt_on_update"):
                raise ValueError(f"algorithm.old_logp_source={self.name}: rollout engine "
                                 f"{type(ctx.engine).__name__} cannot restart in-flight samples at a weight "
                                 "update (use rollout=local or rollout=sglang, or old_logp_source=snapshot)")
            ctx.engine.set_interrupt_on_update(True)
        self.auditor = Auditor(ctx.audit_frac, ctx.seed) if ctx.audit_frac > 0 else None
        self._metrics: dict[str, float] = {}

    @property
    def params(self) -> list[Tensor]:
        return list(self.ctx.policy.model.parameters())

    # ---- hooks ---------------------------------------------------------------------------------------------
    def on_version(self, version: int, finished: FinishedFn = None) -> None:
        if self.store is not None:
            self.store.put(version, self.params)

    def old_logp(self, rb, version: int) -> Tensor | None:
        logp = self.compute(rb, version)
        if self.auditor is not None:
            ref = logp if logp is not None else rb.rollout_logp
            self._metrics.update(self.auditor.measure(self.ctx.policy, self.store, rb, ref, version,
                                                      self.ctx.temperature))
        if self.store is not None:  # no later round can hold a token older than version + 1 - k
            self.store.free_below(version + 1 - self.ctx.staleness)
        return logp

    def compute(self, rb, version: int) -> Tensor | None:
        raise NotImplementedError

    @property
    def reusable(self) -> bool:
        """True: the trainer may take old_logp from the update's own forward (detached) instead of `old_logp`,
        on rounds of one update. Not with the audit, which measures this source's log-probs before the update."""
        return self.from_live_weights and self.auditor is None

    # ---- checkpoint (per rank: each rank's own shard of every stored version) ------------------------------
    def state_dict(self) -> dict:
        """What an exact resume needs: the stored weight versions that samples restored from the checkpoint (the
        async schedule keeps finished, unconsumed rounds) were generated with. At most max_staleness + 1 copies."""
        return {"store": self.store.state_dict()} if self.store is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.store is not None and state.get("store"):
            self.store.load_state_dict(state["store"])

    def metrics(self) -> dict[str, float]:
        m = dict(self._metrics)
        if self.store is not None:  # the source's own copies, or the audit's (measurement overhead only)
            kind = "snapshot" if self.keeps_versions else "audit_store"
            m[f"old_logp_{kind}s"] = float(len(self.store.versions))
            m[f"old_logp_{kind}_gb"] = self.store.nbytes / 2**30
        engine = self.ctx.engine
        if self.needs_interrupt and engine is not None and hasattr(engine, "stats"):
            m["old_logp_regenerated_samples"] = float(engine.stats.regenerated)
        return m


def recompute_logp(ctx: SourceContext, rb) -> Tensor | None:
    """The trainer's forward with its live weights (None off the last PP stage)."""
    return ctx.policy.logprobs(rb.policy_batch(), ctx.temperature)
