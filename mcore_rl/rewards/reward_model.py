"""`rm` reward: a reward model's score for each (prompt, response).

`reward=rm reward.rm.path=RM_FOLDER` reads an HF `*ForSequenceClassification` folder (tokenizer, chat template,
weights). Each sample is rendered with the RM's *own* tokenizer and chat template, not the policy's: an RM was
trained on its template's tokens and scores anything else off-distribution. `template=chat` renders
`[*prompt messages (or one user message), {"role": "assistant", "content": response}]` without a generation
prompt; `template=text` the prompt's text followed by the response, with the tokenizer's special tokens (for RMs
without a chat template). The token rows go to a `TokenScorer`:
- `placement=trainer` (default): the trainer's Megatron RM (given to `build_reward` as `scorers[part]`);
- `placement=server`: `ClassifyScorer` (rewards/classify.py), HTTP `/classify` of `mcore-rl-serve --is-embedding`
  or SGLang 0.5.23 servers (`urls`, round-robin, a retry to the next). Not through sglang-router: 0.3.2 does not
  forward `/classify` (404, tests/rollout/test_serve_classify.py), and its `/v1/classify` answers softmax
  probabilities (1.0 for a one-logit RM), so the client spreads the load over the servers itself.

The score is logit column `label`. A row longer than `max_length` tokens is not scored: 0, reason `too_long`
(counted as `reward_rm_too_long`). `normalize=group` z-scores the scores of one prompt's samples within a score()
call, `batch` all of the call's samples, `none` (default) keeps the raw logit: (x - mean) / (std + 1e-6), population
std; rows that were not scored neither enter the statistics nor change (they stay 0). The raw logit is logged per
sample as `reward/rm_score`. An RM has no notion of a right answer: `correct` is always False (combine with
math_verify for accuracy). A row the scorer could not score (it answers NaN; ClassifyScorer after its retries)
scores 0 with reason `remote_error:<kind>`, or `invalid:nan` for a model that produced NaN.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter, defaultdict
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mcore_rl.rewards.base import RewardResult, check_lengths
from mcore_rl.rewards.http_client import check_key_file, check_policy, check_urls, shown_url
from mcore_rl.rewards.registry import register_reward
from mcore_rl.utils import config_from_dict

logger = logging.getLogger(__name__)
OK = "ok"
TOO_LONG = "too_long"
NORMALIZE_EPS = 1e-6  # added to the std: a group whose samples scored the same gets 0, not a division by zero
PLACEMENTS, TEMPLATES, NORMALIZE = ("trainer", "server"), ("chat", "text"), ("none", "group", "batch")
TRAINER_ONLY = (
    "reward.rm.placement=trainer is scored by the trainer's Megatron RM; outside mcore-rl-train use "
    "placement=server"
)


class TokenScorer(Protocol):
    """Scores token rows with the RM: one scalar per row (logit column `label`), order kept; NaN for a row it
    could not score (the reward then scores it 0 and names why)."""

    def score_ids(self, rows: list[list[int]]) -> list[float]: ...

    def close(self) -> None: ...


@dataclass
class RewardModelConfig:
    path: str | None = None  # HF *ForSequenceClassification folder: tokenizer, chat template, weights
    placement: str = "trainer"  # trainer: the trainer's Megatron RM | server: HTTP /classify
    label: int = 0  # the logit column that is the score
    template: str = "chat"  # chat: the RM's chat template | text: prompt text + response
    max_length: int = 4096  # tokens; a longer rendered row scores 0, reason too_long
    normalize: str = "none"  # none | group (z-score over one prompt's samples) | batch (over the whole call)
    urls: list[str] = field(default_factory=list)  # server: base URLs (http://host:port), round-robin
    batch_size: int = 16  # server: rows per /classify request
    max_concurrency: int = 4  # server: requests in flight
    timeout_s: float = 60.0  # server: per attempt
    max_attempts: int = 5  # server: attempts per request (timeouts, connection errors, 5xx, 408, 429 retried)
    backoff_s: float = 1.0  # server: wait before the 2nd attempt, doubling (at most 30 s)
    api_key_file: str | None = None  # server: mode-600 file; sent as "Authorization: Bearer <key>"

    def __post_init__(self) -> None:
        for key, allowed in (("placement", PLACEMENTS), ("template", TEMPLATES), ("normalize", NORMALIZE)):
            if getattr(self, key) not in allowed:
                raise ValueError(
                    f"reward.rm.{key}={getattr(self, key)!r}: expected one of {', '.join(allowed)}"
                )
        if self.label < 0:
            raise ValueError(f"reward.rm.label={self.label} must be >= 0")
        for key in ("max_length", "batch_size"):
            if getattr(self, key) <= 0:
                raise ValueError(f"reward.rm.{key}={getattr(self, key)!r} must be > 0")
        check_policy(self, "reward.rm")


def rm_endpoints(cfg: RewardModelConfig, where: str = "reward.rm") -> list[str]:
    """placement=server: `urls`, each an http(s) URL of an RM server; no trailing slash."""
    if not cfg.urls:
        raise ValueError(
            f"{where}.placement=server needs {where}.urls=[http://host:port,...] (the RM servers themselves: "
            "sglang-router does not forward /classify)"
        )
    return [u.rstrip("/") for u in check_urls(list(cfg.urls), where)]


def check_rm(cfg: RewardModelConfig, where: str = "reward.rm") -> None:
    """Before any model is built: the folder is a classifier whose logits have column `label`, and for
    placement=server the endpoints parse and the key file is mode 600."""
    if not cfg.path:
        raise ValueError(
            f"{where}.path is not set: give the reward model's HF folder, e.g. {where}.path=/models/rm"
        )
    config = Path(cfg.path) / "config.json"
    try:
        hf = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{where}.path={cfg.path!r}: cannot read {config.name} ({type(e).__name__})"
        ) from None
    archs = hf.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        raise ValueError(
            f"{where}.path={cfg.path!r}: config.json's architectures are {archs}; expected a "
            "*ForSequenceClassification model"
        )
    num_labels = len(hf.get("id2label") or {}) or int(hf.get("num_labels", 2))
    if cfg.label >= num_labels:
        raise ValueError(f"{where}.label={cfg.label}: the model has {num_labels} logit column(s)")
    if cfg.placement == "server":
        rm_endpoints(cfg, where)
        check_key_file(cfg.api_key_file, where)


def prompt_messages(prompt: Any) -> list[dict[str, str]]:
    """A record's prompt as chat messages: a message list kept as is, text (or nothing) as one user message."""
    if isinstance(prompt, list):
        return [dict(m) for m in prompt]
    return [{"role": "user", "content": "" if prompt is None else str(prompt)}]


def prompt_plain(prompt: Any) -> str:
    """A record's prompt as text: the text, or the messages' contents one per line."""
    if isinstance(prompt, list):
        return "\n".join(str(m.get("content", "")) for m in prompt if isinstance(m, dict))
    return "" if prompt is None else str(prompt)


class Renderer:
    """(prompt, response) -> the RM's token ids, with the RM's tokenizer and template (see the module docstring)."""

    def __init__(self, path: str, template: str, where: str = "reward.rm") -> None:
        from transformers import AutoTokenizer

        self.tok, self.template = AutoTokenizer.from_pretrained(path), template
        if template == "chat" and not getattr(self.tok, "chat_template", None):
            raise ValueError(f"{where}.template=chat: {path} has no chat template; use {where}.template=text")

    def render(self, prompt: Any, response: str) -> list[int]:
        if self.template == "text":
            return list(self.tok(prompt_plain(prompt) + response, add_special_tokens=True)["input_ids"])
        messages = [*prompt_messages(prompt), {"role": "assistant", "content": response}]
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        return list(self.tok(text, add_special_tokens=False)["input_ids"])


def normalize(scores: list[float | None], keys: list[Hashable], mode: str) -> list[float | None]:
    """z-scores per key (`group`: a prompt id) or over all (`batch`); None (not scored) stays None."""
    if mode == "none":
        return list(scores)
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, (s, k) in enumerate(zip(scores, keys)):
        if s is not None:
            groups[k if mode == "group" else None].append(i)
    out = list(scores)
    for idx in groups.values():
        xs = [scores[i] for i in idx]
        mean = sum(xs) / len(xs)
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
        for i, x in zip(idx, xs):
            out[i] = (x - mean) / (std + NORMALIZE_EPS)
    return out


class RewardModelReward:
    """Renders, scores through a TokenScorer, normalises; see the module docstring."""

    def __init__(self, cfg: RewardModelConfig, scorer: TokenScorer, where: str = "reward.rm") -> None:
        self.cfg, self.scorer, self.where = cfg, scorer, where
        self.renderer = Renderer(str(cfg.path), cfg.template, where)
        self._counts: Counter = Counter()

    def score(
        self, responses: list[str], answers: list[str], records: list[dict] | None = None
    ) -> list[RewardResult]:
        check_lengths(responses, answers, records)
        records = records if records is not None else [{} for _ in responses]
        rows = [self.renderer.render(r.get("prompt"), resp or "") for r, resp in zip(records, responses)]
        keep = [i for i, row in enumerate(rows) if len(row) <= self.cfg.max_length]
        got = self.scorer.score_ids([rows[i] for i in keep]) if keep else []
        if len(got) != len(keep):
            raise RuntimeError(f"{self.where}: the scorer returned {len(got)} scores for {len(keep)} rows")
        raw: list[float | None] = [None] * len(rows)
        reasons = [TOO_LONG] * len(rows)
        errors = getattr(self.scorer, "last_errors", None) or {}
        for j, (i, s) in enumerate(zip(keep, got)):
            ok = isinstance(s, (int, float)) and math.isfinite(s)
            raw[i], reasons[i] = (float(s), OK) if ok else (None, errors.get(j, "invalid:nan"))
        keys = [r.get("prompt_id") for r in records]
        final = normalize(raw, keys, self.cfg.normalize)
        self._counts.update(
            reward_rm_too_long=len(rows) - len(keep),
            reward_rm_failures=sum(r not in (OK, TOO_LONG) for r in reasons),
        )
        if len(keep) < len(rows):
            logger.warning(
                "rm reward: %d of %d samples longer than max_length=%d tokens scored 0 (too_long)",
                len(rows) - len(keep),
                len(rows),
                self.cfg.max_length,
            )
        return [
            RewardResult(0.0 if f is None else f, False, why, None, 0.0, {} if x is None else {"rm_score": x})
            for f, x, why in zip(final, raw, reasons)
        ]

    def metrics(self) -> dict[str, float]:
        """Counts since the last call: too_long rows, rows not scored, and the scorer's own (HTTP requests)."""
        out = {k: float(self._counts[k]) for k in ("reward_rm_too_long", "reward_rm_failures")}
        self._counts.clear()
        if hasattr(self.scorer, "metrics"):
            out.update(self.scorer.metrics())
        return out

    def describe(self) -> str:
        c = self.cfg
        where = (
            f"server {', '.join(shown_url(u) for u in self.scorer.urls)}"  # type: ignore[attr-defined]
            if c.placement == "server"
            else "trainer (Megatron)"
        )
        extra = (
            f", batch_size={c.batch_size}, max_concurrency={c.max_concurrency}, timeout_s={c.timeout_s:g} per "
            f"attempt, max_attempts={c.max_attempts}, backoff_s={c.backoff_s:g}, api key: "
            f"{'from api_key_file' if c.api_key_file else 'none'}"
            if c.placement == "server"
            else ""
        )
        return (
            f"rm {c.path} (placement={where}; label={c.label}, template={c.template}, max_length={c.max_length}, "
            f"normalize={c.normalize}{extra})"
        )

    def close(self) -> None:
        self.scorer.close()


@register_reward("rm", RewardModelConfig, check=check_rm)
def build_rm(
    options: dict[str, Any], scorer: TokenScorer | None = None, where: str = "reward.rm"
) -> RewardModelReward:
    """placement=server builds its own ClassifyScorer (a given `scorer` is not used); placement=trainer needs the
    trainer's (`build_reward(cfg, scorers={part: scorer})`)."""
    cfg = config_from_dict(RewardModelConfig, options, where)
    check_rm(cfg, where)
    if cfg.placement == "trainer":
        if scorer is None:
            raise ValueError(TRAINER_ONLY)
        return RewardModelReward(cfg, scorer, where)
    from mcore_rl.rewards.classify import ClassifyScorer

    own = ClassifyScorer(rm_endpoints(cfg, where), cfg)
    try:
        return RewardModelReward(cfg, own, where)
    except Exception:
        own.close()
        raise
