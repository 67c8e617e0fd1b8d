"""Host-memory copies of the policy weights per version, and per-token-version scoring against them.

Each rank keeps its own TP/PP shard of every version (the live parameter list, in order), on CPU. Scoring a
batch under the versions that produced its tokens runs one forward per distinct version present and takes each
token's log-prob from its own version: a log-prob at position t depends only on the prefix, so scoring the
whole row under version v is exact for the tokens v generated, even when the row spans versions (partial
rollouts). Versions no unconsumed sample can reference are freed; the caller says which (`free_below`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from mcore_rl.utils import params_swapped


class MissingVersionError(RuntimeError):
    """A token's generating version has no stored weights: an exact old log-prob cannot be computed."""


class VersionStore:
    def __init__(self) -> None:
        self._weights: dict[int, list[Tensor]] = {}

    def put(self, version: int, params: Sequence[Tensor]) -> None:
        """Copy the live (local shard) params as `version`; an existing copy of that version is replaced."""
        self._weights[int(version)] = [p.detach().to("cpu", copy=True) for p in params]

    def free_below(self, version: int) -> None:
        for v in [v for v in self._weights if v < version]:
            del self._weights[v]

    def state_dict(self) -> dict[int, list[Tensor]]:
        return dict(self._weights)

    def load_state_dict(self, state: dict[int, list[Tensor]]) -> None:
        self._weights = {int(v): list(ts) for v, ts in state.items()}

    def __contains__(self, version: int) -> bool:
        return int(version) in self._weights

    @property
    def versions(self) -> list[int]:
        return sorted(self._weights)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self._weights.values() for t in ts)

    @contextmanager
    def swapped_in(self, version: int, params: Sequence[Tensor]) -> Iterator[None]:
        """Temporarily load `version` into the live params, then restore them bit for bit."""
        if version not in self._weights:
            raise MissingVersionError(f"old log-probs: weight version {version} is not stored (have "
                                      f"{self.versions}); a sample is staler than max_staleness allows")
        saved = self._weights[version]
        if len(saved) != len(params):
            raise ValueError(f"version {version}: {len(saved)} stored tensors, the model has {len(params)}")
        with params_swapped(params, saved):
            yield


def token_versions(rb) -> list[int]:
    """Distinct weight versions of the batch's response tokens, ascending."""
    v = rb.versions[rb.loss_mask > 0]
    return sorted(set(v.tolist()))


def score_by_version(policy, store: VersionStore | None, rb, current_version: int,
                     temperature: float) -> Tensor | None:
    """Each response token's log-prob under the weights of the version that produced it. Tokens of the current
    version use the live weights (no copy needed). None off the last PP stage (all ranks must call: collective)."""
    params = list(policy.model.parameters())
    batch = rb.policy_batch()
    out = None
    for v in token_versions(rb) or [current_version]:
        if v == current_version:
            logp = policy.logprobs(batch, temperature)
        else:
            with store_or_fail(store, v).swapped_in(v, params):
                logp = policy.logprobs(batch, temperature)
        if logp is None:  # not the last pipeline stage: the forward still had to run
            continue
        out = torch.zeros_like(logp) if out is None else out
        sel = rb.versions == v
        out[sel] = logp[sel]
    return out


def store_or_fail(store: VersionStore | None, version: int) -> VersionStore:
    if store is None:
        raise MissingVersionError(f"old log-probs: token of version {version} but no weight store is kept")
    return store
