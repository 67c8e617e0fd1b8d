"""`remote` reward: an HTTP reward service speaking OpenRLHF's remote reward model protocol.

`reward=remote reward.remote.url=http://host:5000/get_reward` POSTs `{"query": [...], "prompts": [...], "labels":
[...]}` (three lists of equal length: the templated prompt followed by the response, decoded with special tokens
kept; the templated prompt; the gold answer) and reads `{"rewards": [...], "scores"?: [...], "extra_logs"?: {key:
[...]}}`. That is what OpenRLHF sends and reads (`openrlhf/utils/remote_rm_utils.py` v0.9.0, `utils/agent.py`
v0.11.0, reference server `openrlhf/cli/serve_rm.py`), so a service written for OpenRLHF works unchanged.

Unlike OpenRLHF (5 attempts with 1 s sleeps, then an exception or a silently missing reward), requests go through
the shared client of http_client.py (concurrency limit, per-attempt timeout, exponential backoff on timeouts,
connection errors, 5xx, 408 and 429, the next URL on a retry, the API key from a mode-600 file); after its last
attempt, or at once on a malformed body or another 4xx, each of a request's samples scores 0 with reason
`remote_error:<kind>` (timeout, connection, http_<status>, malformed), counted in `reward_remote_failures` and
named in one warning line per step.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from mcore_rl.rewards.base import RewardResult, check_lengths, finite_number
from mcore_rl.rewards.http_client import (
    HttpClient,
    check_key_file,
    check_policy,
    check_urls,
    count_outcomes,
    failure_summary,
    policy_of,
    shown_url,
)
from mcore_rl.rewards.registry import register_reward
from mcore_rl.utils import config_from_dict

logger = logging.getLogger(__name__)
OK = "ok"


@dataclass
class RemoteRewardConfig:
    url: str | None = None  # the service's endpoint (OpenRLHF's --remote_rm_url), e.g. http://host:5000/get_reward
    urls: list[str] = field(default_factory=list)  # several endpoints: batches go round-robin, retries to the next
    batch_size: int = 32  # samples per request
    max_concurrency: int = 4  # requests in flight at once
    timeout_s: float = 60.0  # per attempt (connect + answer)
    max_attempts: int = 5  # attempts per request, the first included
    backoff_s: float = 1.0  # wait before the second attempt; doubles each time (at most 30 s)
    api_key_file: str | None = None  # mode-600 file holding the key, sent as "Authorization: Bearer <key>"

    def __post_init__(self) -> None:
        if self.batch_size <= 0:
            raise ValueError(f"reward.remote.batch_size={self.batch_size!r} must be > 0")
        check_policy(self, "reward.remote")


def endpoints(cfg: RemoteRewardConfig, where: str = "reward.remote") -> list[str]:
    """`url` then `urls`, each checked to be an http(s) URL with a host."""
    found = ([cfg.url] if cfg.url else []) + [u for u in cfg.urls if u != cfg.url]
    if not found:
        raise ValueError(f"{where}.url is not set: give the service's endpoint, e.g. "
                         f"{where}.url=http://host:5000/get_reward (or {where}.urls=[...])")
    return check_urls(found, where)


def check_remote(cfg: RemoteRewardConfig, where: str = "reward.remote") -> None:
    """Before any model is built: the endpoints parse and the key file is readable, mode 600."""
    endpoints(cfg, where)
    check_key_file(cfg.api_key_file, where)


def prompt_text(record: dict) -> str:
    """The templated prompt the trainer adds (`prompt_text`); without it (a caller with no tokenizer) the raw
    prompt: the text itself, or the messages' contents one per line."""
    if record.get("prompt_text") is not None:
        return str(record["prompt_text"])
    prompt = record.get("prompt")
    if isinstance(prompt, list):
        return "\n".join(str(m.get("content", "")) for m in prompt if isinstance(m, dict))
    return "" if prompt is None else str(prompt)


def parse_rewards(body: Any, n: int) -> list[tuple[float, bool, str, dict[str, float]]] | None:
    """OpenRLHF's response -> per-sample (score, correct, reason, extra metrics); None when malformed. `rewards`
    is the score; `correct` is `scores` (falling back to `rewards`, as OpenRLHF does) >= 1; `extra_logs` lists of
    numbers become metrics (others are not logged)."""
    if not isinstance(body, dict) or not isinstance(body.get("rewards"), list) or len(body["rewards"]) != n:
        return None
    rewards = body["rewards"]
    scores = body.get("scores")
    scores = scores if isinstance(scores, list) and len(scores) == n else rewards
    logs = body.get("extra_logs") if isinstance(body.get("extra_logs"), dict) else {}
    logs = {k: v for k, v in logs.items() if isinstance(k, str) and isinstance(v, list) and len(v) == n}
    out = []
    for i in range(n):
        r = finite_number(rewards[i])
        if isinstance(r, str):
            out.append((0.0, False, r, {}))
            continue
        s = finite_number(scores[i])
        metrics = {k: float(v[i]) for k, v in logs.items() if isinstance(finite_number(v[i]), float)}
        out.append((r, isinstance(s, float) and s >= 1.0, OK, metrics))
    return out


class RemoteReward:
    """Scores through the service; see the module docstring for the protocol and the failure handling."""

    uses_text = True  # records carry the templated prompt and the query (trainer/rounds.py)

    def __init__(self, cfg: RemoteRewardConfig, where: str = "reward.remote") -> None:
        self.cfg, self.urls = cfg, endpoints(cfg, where)
        self._client = HttpClient(self.urls, policy_of(cfg), cfg.api_key_file, name="remote reward")
        self._counts: Counter = Counter()

    def score(self, responses: list[str], answers: list[str], records: list[dict] | None = None
              ) -> list[RewardResult]:
        check_lengths(responses, answers, records)
        records = records if records is not None else [{"answer": a} for a in answers]
        prompts = [prompt_text(r) for r in records]
        queries = [r.get("query") or p + (resp or "") for r, p, resp in zip(records, prompts, responses)]
        labels = ["" if a is None else a for a in answers]
        n = self.cfg.batch_size
        spans = [(i, min(i + n, len(responses))) for i in range(0, len(responses), n)]
        payloads = [{"query": queries[a:b], "prompts": prompts[a:b], "labels": labels[a:b]} for a, b in spans]
        outcomes = self._client.post_all(payloads, lambda k, body: parse_rewards(body, spans[k][1] - spans[k][0]))
        results: list[RewardResult] = []
        for (a, b), o in zip(spans, outcomes):
            if o.value is None:
                results += [RewardResult(0.0, False, f"remote_error:{o.kind}", None) for _ in range(b - a)]
            else:
                results += [RewardResult(s, c, r, None, 0.0, m) for s, c, r, m in o.value]
        count_outcomes(self._counts, "reward_remote", outcomes)
        if line := failure_summary(outcomes, [b - a for a, b in spans]):
            logger.warning("remote reward: %s scored 0 (reason remote_error:<kind>)", line)
        return results

    def metrics(self) -> dict[str, float]:
        """Request counts since the last call (the trainer reads them once per scored round)."""
        out = {k: float(self._counts[k]) for k in
               ("reward_remote_requests", "reward_remote_requests_failed", "reward_remote_retries")}
        self._counts.clear()
        return out

    def describe(self) -> str:
        c = self.cfg
        return (f"remote {', '.join(shown_url(u) for u in self.urls)} (OpenRLHF protocol; batch_size={c.batch_size}, "
                f"max_concurrency={c.max_concurrency}, timeout_s={c.timeout_s:g} per attempt, "
                f"max_attempts={c.max_attempts}, backoff_s={c.backoff_s:g}, "
                f"api key: {'from api_key_file' if c.api_key_file else 'none'})")

    def close(self) -> None:
        self._client.close()


@register_reward("remote", RemoteRewardConfig, check=check_remote)
def build_remote(options: dict[str, Any]) -> RemoteReward:
    return RemoteReward(config_from_dict(RemoteRewardConfig, options, "reward.remote"))
