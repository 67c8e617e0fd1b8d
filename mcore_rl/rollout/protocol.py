"""The one engine protocol the trainer talks to, whatever engine (in-process, SGLang over HTTP) is behind it.

Log-prob convention (matches SGLang, and the trainer computes its own log-probs the same way):
``log_softmax(logits / T)`` in float32 at the sampled token -- temperature-scaled but NOT truncated by
top-p / top-k. Greedy decoding (``temperature == 0``) reports ``log_softmax(logits)`` (T = 1), as SGLang does.

Every output token carries the weight version that produced it, so staleness and off-policy corrections are
exact even when a weight update lands in the middle of a sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from mcore_rl.registry import Registry

FinishReason = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")


@dataclass
class SamplingParams:
    """Per-request sampling settings (names follow SGLang's ``sampling_params`` where they overlap)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = disabled, as in SGLang
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.top_k is None or self.top_k == 0:
            self.top_k = -1
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 1, "must be >= 1"),
            ("temperature", self.temperature >= 0.0, "must be >= 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k == -1 or self.top_k >= 1, "must be -1 (disabled) or >= 1"),
            ("n", self.n >= 1, "must be >= 1"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} {why}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class GenerationRequest:
    """One prompt (token ids) to complete ``sampling.n`` times."""

    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.prompt_ids, torch.Tensor):
            self.prompt_ids = self.prompt_ids.tolist()
        if not self.prompt_ids:
            raise ValueError(f"GenerationRequest(rid={self.rid!r}).prompt_ids is empty")
        self.prompt_ids = [int(t) for t in self.prompt_ids]


@dataclass
class Sample:
    """One completion. ``output_logprobs[i]`` and ``weight_versions[i]`` belong to ``output_ids[i]``."""

    rid: str | None
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    weight_versions: list[int]
    finish_reason: FinishReason
    text: str | None = None
    matched_stop: int | str | None = None  # the stop token id or stop string that ended the sample
    sample_index: int = 0  # which of the request's n samples this is
    metadata: dict[str, Any] = field(default_factory=dict)
    # 1 where the policy produced output_ids[i]; None = all of them. A multi-turn episode (mcore_rl/envs) is one
    # Sample whose tool / environment tokens between turns are 0 here (no loss, log-prob 0.0, version -1).
    output_mask: list[int] | None = None

    def __post_init__(self) -> None:
        n = len(self.output_ids)
        if len(self.output_logprobs) != n or len(self.weight_versions) != n:
            raise ValueError(
                f"Sample(rid={self.rid!r}): {n} output_ids but {len(self.output_logprobs)} logprobs and "
                f"{len(self.weight_versions)} weight_versions"
            )
        if self.output_mask is not None and len(self.output_mask) != n:
            raise ValueError(f"Sample(rid={self.rid!r}): {n} output_ids but {len(self.output_mask)} mask entries")

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a generation engine. Implementations: ``local``, ``sglang``."""

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Sample]:
        """Complete every request; ``n > 1`` expands to n consecutive samples per request, order kept."""
        ...

    def submit(self, requests: Sequence[GenerationRequest]) -> list[Future]:
        """Start generating without blocking: one ``Future[Sample]`` per sample, in ``generate`` order."""
        ...

    def wait(self, futures: Sequence[Future], timeout: float | None = None) -> bool:
        """Block until every future (of this engine's or of work built on it) is done: True, or False once
        ``timeout`` seconds passed. An in-process engine may run its own steps on the caller's thread meanwhile."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load full tensors under their HF names and tag later tokens with ``version``."""
        ...

    def update_weights_from_disk(self, path: str, version: int) -> None: ...

    def pause(self, mode: PauseMode = "abort") -> None: ...

    def resume(self) -> None: ...

    def abort(self, rid: str | None = None) -> None:
        """Abort one request (all its n samples) or, with ``None``, everything in flight."""
        ...

    def release_memory(self) -> None: ...

    def resume_memory(self) -> None: ...

    def health(self) -> bool: ...

    @property
    def weight_version(self) -> int: ...

    def close(self) -> None: ...


ENGINES: Registry[Callable[..., RolloutEngine]] = Registry(
    "rollout.engine", {"local": "mcore_rl.rollout.local.engine", "sglang": "mcore_rl.rollout.sglang.remote_engine"}
)


class EngineFailure(RuntimeError):
    """The engine cannot go on (e.g. a server that keeps dying); the run stops with this one line."""


def register_engine(name: str) -> Callable[[Callable[..., RolloutEngine]], Callable[..., RolloutEngine]]:
    return ENGINES.register(name)


def build_engine(name: str, **kwargs: Any) -> RolloutEngine:
    """Build a registered engine by name (``local`` | ``sglang``); only that engine's module is imported."""
    return ENGINES.get(name)(**kwargs)


def expand_requests(requests: Sequence[GenerationRequest]) -> list[tuple[GenerationRequest, int]]:
    """(request, sample_index) pairs in the protocol's output order: request-major, n samples each."""
    return [(req, j) for req in requests for j in range(req.sampling.n)]


def sample_seed(seed: int | None, sample_index: int) -> int | None:
    """Distinct, reproducible seed for sample j of a seeded request (None stays None).

    Sample 0 keeps the request's seed as given: a client that splits a request into one request per sample sends
    `sample_seed(seed, j)` as each one's `sampling_seed`, and SGLang (and mcore-rl-serve) use that seed unchanged,
    so both paths draw the same tokens.
    """
    if seed is None:
        return None
    if sample_index == 0:
        return int(seed) % (2**63 - 1)
    return (int(seed) * 1_000_003 + sample_index) % (2**63 - 1)
