"""Interrupt-mode bookkeeping of the SGLang client (old_logp_source=interrupt|old_logit_model).

Why: those sources need every sample's tokens from ONE weight version. SGLang gives that at a weight update sent
with `abort_all_requests=true`: it aborts every request in flight (a running one answers finish_reason
{"type": "abort", "message": "Aborted", ...} with its partial output, a queued one "Abort in waiting queue"
with none) and loads the weights under the writer side of its model_update_lock, which every /generate holds the reader
side of for its whole life. What is left to the client: hold new sends until every worker holds the new version
(`gate`), and tell a sample aborted by such an update (send it again from its prompt, same sampling_seed) from one
the caller aborted (return it as an abort).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from mcore_rl.rollout.protocol import Sample

Mark = tuple[int, int]  # (updates, caller aborts) when a sample was sent


@dataclass
class Interrupts:
    enabled: bool = False
    updates: int = 0  # interrupting weight updates started so far
    caller_aborts: int = 0  # abort(None) / pause("abort") calls so far
    caller_aborted: set[str] = field(default_factory=set)  # sample rids the caller aborted one by one
    _open: asyncio.Event | None = None  # set unless an interrupting update is under way (made in the loop)

    def gate(self) -> asyncio.Event:
        if self._open is None:
            self._open = asyncio.Event()
            self._open.set()
        return self._open

    def mark(self) -> Mark:
        return self.updates, self.caller_aborts

    def restart(self, srid: str, sample: Sample, sent: Mark) -> bool:
        """True when an interrupting update aborted `sample` after it was sent (`sent = mark()` then)."""
        if self.enabled and len(set(sample.weight_versions)) > 1:
            raise RuntimeError(
                f"interrupt mode: sample {srid} came back with tokens of weight versions "
                f"{sorted(set(sample.weight_versions))}: the server changed weights mid-sample without aborting it "
                "(it does not honour abort_all_requests)"
            )
        return (sample.finish_reason == "abort" and self.updates > sent[0] and self.caller_aborts == sent[1]
                and srid not in self.caller_aborted)  # fmt: skip

    def begin(self) -> None:
        """Before an update: new sends wait; samples sent earlier that come back aborted are sent again."""
        if self.enabled:
            self.gate().clear()
            self.updates += 1

    def end(self) -> None:
        self.gate().set()

    def payload(self) -> dict[str, bool]:
        """What a weight-update body adds (tensor/nccl: the first bucket only)."""
        return {"abort_all_requests": True} if self.enabled else {}
