"""`old_logit_model`: a dedicated forward-only copy of the policy that holds the behaviour version and scores
samples as they finish, before it moves on to the next version (no per-version snapshots kept).

Partial rollouts: a sample generated across a weight update would need two behaviour models. We combine with the
engine's interrupt mode instead: at each weight update the engine restarts in-flight samples from their prompt,
so every finished sample carries exactly one version. At each new version v+1 (after the engine holds it, so no
more version-v tokens can appear), the model -- still holding v -- scores every finished, not yet consumed
version-v sample, caches its log-probs (keyed by token content and version), and then loads v+1. Samples that
finish under the trainer's current version are scored when their round is consumed. Exact: each token is scored
by a model holding its own version.

Multi-turn episodes (env=NAME): the engine's interrupt mode restarts a *turn* at an update, so an episode holds one
version per turn, possibly several. The unit scored at a version hook is then the finished turn (the episode's
prefix up to and including it, offered by the episode launcher as it completes), cached under (prefix tokens,
version); a consumed episode takes each turn's log-probs from the entry of its own prefix and version, and only
turns of the held version are scored when consumed.
"""

from __future__ import annotations

import torch

from mcore_rl.batch import build_rollout_batch
from mcore_rl.distributed import broadcast_object
from mcore_rl.oldlogp.base import OldLogpSource, SourceContext
from mcore_rl.oldlogp.interrupt import check_single_version, turn_spans
from mcore_rl.oldlogp.registry import register_source


def _span_keys(tokens: torch.Tensor, mask: torch.Tensor, versions: torch.Tensor) -> list[tuple[int, int, tuple]]:
    """Per model turn of a row: (start, end, key); key = (the row's tokens through the turn, the turn's version).
    A log-prob depends only on the tokens before it, so a turn scored as the end of its prefix is the same turn
    scored inside the whole episode."""
    toks = tokens.tolist()
    return [(a, b, (tuple(toks[:b]), int(versions[a]))) for a, b in turn_spans(mask)]


@register_source("old_logit_model")
class OldLogitModelSource(OldLogpSource):
    needs_interrupt = True
    exact = True

    def __init__(self, ctx: SourceContext) -> None:
        super().__init__(ctx)
        if ctx.make_policy is None:
            raise ValueError("old_logp_source=old_logit_model needs a policy factory")
        self.model = ctx.make_policy()
        self.held: int | None = None
        self.cache: dict[tuple, list] = {}  # (tokens, version) -> [log-probs row, samples not yet consumed]
        self.seen: set[tuple] = set()  # (rid, sample_index, version) scored at a hook
        self.scored_early = 0

    def _load(self, version: int) -> None:
        src = dict(self.ctx.policy.gpt.named_parameters())
        with torch.no_grad():
            for name, p in self.model.gpt.named_parameters():
                p.copy_(src[name])
        self.held = version

    def on_version(self, version: int, finished=None) -> None:
        super().on_version(version, finished)
        if self.held is not None and version != self.held:
            self._score_finished(finished)
        self._load(version)

    def _score_finished(self, finished) -> None:
        todo = None
        if finished is not None:  # rank 0
            todo = []
            for s in finished():
                if not s.output_ids:
                    continue
                ident = (s.rid, s.sample_index, max(s.weight_versions))
                if ident in self.seen or ident[2] != self.held:
                    continue  # already scored, or generated under the new version (scored later)
                self.seen.add(ident)
                todo.append(s)
        todo = broadcast_object(todo) or []
        if not todo:
            return
        n = len(todo)
        rb = build_rollout_batch(todo, [0.0] * n, [False] * n, list(range(n)))
        check_single_version(rb)
        logp = self.model.logprobs(rb.policy_batch(), self.ctx.temperature)
        for i in range(n):
            for _, b, key in _span_keys(rb.tokens[i], rb.loss_mask[i], rb.versions[i]):
                entry = self.cache.setdefault(key, [None if logp is None else logp[i, :b].clone(), 0])
                entry[1] += 1  # identical samples (same tokens, same version) share one entry
        self.scored_early += n

    def compute(self, rb, version: int):
        check_single_version(rb)
        spans = [_span_keys(rb.tokens[i], rb.loss_mask[i], rb.versions[i]) for i in range(len(rb))]
        unscored = [(i, s) for i, row in enumerate(spans) for s in row if s[2] not in self.cache]
        wrong = sorted({s[2][1] for _, s in unscored if s[2][1] != self.held})
        if wrong:
            raise RuntimeError(f"old_logit_model holds version {self.held} but unscored turns carry versions "
                               f"{wrong}: they finished without being scored at their version")
        miss = sorted({i for i, _ in unscored})
        fresh = self.model.logprobs(rb.select(miss).policy_batch(), self.ctx.temperature) if miss else None
        last = self.model.is_last_stage()
        out = torch.zeros_like(rb.rollout_logp) if last else None
        if last:
            row_of = {i: j for j, i in enumerate(miss)}
            for i, row in enumerate(spans):
                for a, b, key in row:
                    src = self.cache[key][0] if key in self.cache else fresh[row_of[i]]
                    out[i, a:b] = src[a:b]
        keys = [key for row in spans for _, _, key in row]
        for k in keys:
            if k in self.cache:
                self.cache[k][1] -= 1
                if self.cache[k][1] <= 0:
                    del self.cache[k]
        floor = version + 1 - self.ctx.staleness  # entries older than this can never be consumed any more
        self.cache = {k: e for k, e in self.cache.items() if k[1] >= floor}
        self.seen = {s for s in self.seen if s[2] >= floor}
        return out

    def state_dict(self) -> dict:
        """Plus the log-probs already scored at their version for samples not consumed yet (the held weights are
        the trainer's at the checkpoint, reloaded by on_version after a resume)."""
        return {**super().state_dict(), "cache": {k: list(e) for k, e in self.cache.items()},
                "seen": sorted(self.seen), "scored_early": self.scored_early}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.cache = {tuple(k): list(e) for k, e in (state.get("cache") or {}).items()}
        self.seen = {tuple(s) for s in state.get("seen") or []}
        self.scored_early = int(state.get("scored_early", 0))

    def metrics(self) -> dict[str, float]:
        m = super().metrics()
        m["old_logit_model_gb"] = sum(p.numel() * p.element_size() for p in self.model.gpt.parameters()) / 2**30
        m["old_logp_scored_early"] = float(self.scored_early)
        m["old_logp_cached"] = float(len(self.cache))
        return m
