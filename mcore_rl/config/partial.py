"""`partial_rollout.*`: over-issue prompts, stop the round when its batch is full, carry the unfinished samples
(their tokens kept) into the next round (docs/partial_rollouts.md)."""

from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.config.checks import ConfigError, positive


@dataclass
class PartialRolloutConfig:
    enabled: bool = False
    # groups in flight per round = ceil(over_issue x the groups the round trains on): carried groups first, fresh
    # prompts for the rest. 1.0 issues no extra prompts (the carried ones still continue)
    over_issue: float = 2.0
    # the round generates in chunks: each unfinished sample at most this many tokens (an episode: whole turns
    # until it produced this many policy tokens), then it stops if it holds enough complete groups, else runs the
    # next chunk. 0: no chunks (every sample runs to its end in the round it starts; surplus groups are carried)
    chunk_tokens: int = 16
    # tokens generated under an earlier weight version than the one the round trains at get loss-mask 0 (false:
    # they train, corrected by the algorithm's old-logit source)
    mask_stale: bool = False
    # versions a carried sample's oldest token may lag when it trains: a group that old generates to its end in
    # the round, without the per-round cap (bounds what the snapshot / old_logit_model sources keep)
    max_age: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.over_issue, bool) or not self.over_issue >= 1.0:
            raise ConfigError(f"partial_rollout.over_issue={self.over_issue!r} must be >= 1")
        positive("partial_rollout.chunk_tokens", self.chunk_tokens, allow_zero=True)
        positive("partial_rollout.max_age", self.max_age)
