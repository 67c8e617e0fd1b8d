"""`judge` reward: an LLM judge behind an OpenAI-compatible `/v1/chat/completions` grades each response.

`reward=judge reward.judge.url=http://host:30000` POSTs, per sample, `{"model", "messages": [system?, user],
"max_tokens", "temperature"}` (plus `"logprobs": true, "top_logprobs": k` for parser=yes_no_logprobs) to
`{url}/v1/chat/completions` (a url already ending in `/v1` gets `/chat/completions`), the shape of SGLang 0.5.23's
`ChatCompletionRequest` (`sglang/srt/entrypoints/openai/protocol.py`), vLLM's and OpenAI's. The user message is
`template` filled with `{prompt}` (the record's prompt: the text, or the messages' contents one per line),
`{response}` and `{reference}` (the gold answer); `{response}` is required, any other placeholder is refused at
start-up (literal braces are written `{{` `}}`). The reply (`choices[0].message.content`, and for logprobs
`choices[0].logprobs.content[0].top_logprobs`) becomes a score in [0, 1] by `parser`:
- `number`: the last number in the reply, mapped from [min_score, max_score] to [0, 1] (clipped);
- `boxed`: the content of the last `\\boxed{}`, a number, mapped the same way;
- `yes_no`: the reply's first word: yes -> 1, no -> 0;
- `yes_no_logprobs`: P(yes) / (P(yes) + P(no)) over the first token's `top_logprobs` (token text stripped of spaces
  and punctuation, case ignored; each variant's probability added): a graded score from one token.
`correct` is score >= 0.5. Identical request bodies (e.g. the same response to the same prompt, at any
temperature) are sent once per score() call (counted in `reward_judge_cache_hits`).

Failures never stop the run: a reply the parser cannot read scores 0 with reason `parse_error`
(`reward_judge_parse_failures`), a request that failed after its retries (http_client.py) `judge_error:<kind>`
(`reward_judge_errors`; counted by reward.max_crash_rate like a crashed verifier); one warning line per step names
them, with the start of one unreadable reply.
"""

from __future__ import annotations

import json
import logging
import math
import re
import string
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mcore_rl.rewards.base import RewardResult, check_lengths
from mcore_rl.rewards.extract import last_boxed
from mcore_rl.rewards.http_client import (
    HttpClient,
    check_key_file,
    check_policy,
    check_urls,
    count_outcomes,
    policy_of,
    shown_url,
)
from mcore_rl.rewards.registry import register_reward
from mcore_rl.rewards.reward_model import prompt_plain
from mcore_rl.utils import config_from_dict

logger = logging.getLogger(__name__)
OK, PARSE_ERROR = "ok", "parse_error"
PLACEHOLDERS = ("prompt", "response", "reference")
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
DEFAULT_SYSTEM = "You grade answers to questions. Reply with one word: yes or no."
DEFAULT_TEMPLATE = (
    "Question:\n{prompt}\n\nReference answer:\n{reference}\n\nResponse to grade:\n{response}\n\n"
    "Is the response's final answer correct (does it agree with the reference)? Answer yes or no."
)


@dataclass
class JudgeConfig:
    url: str | None = None  # base URL of an OpenAI-compatible server: http://host:port (or .../v1)
    model: str = "default"  # the request's "model" (SGLang and mcore-rl-serve accept "default")
    api_key_file: str | None = None  # mode-600 file; sent as "Authorization: Bearer <key>"
    system: str = DEFAULT_SYSTEM  # the system message; empty: none is sent
    template: str = DEFAULT_TEMPLATE  # the user message, over {prompt}, {response} (required), {reference}
    parser: str = "yes_no"  # number | boxed | yes_no | yes_no_logprobs
    min_score: float = 0.0  # number/boxed: the judge's scale, mapped to [0, 1]
    max_score: float = 10.0
    top_logprobs: int = 5  # yes_no_logprobs: alternatives returned for the first token
    max_tokens: int = 16  # the reply's length limit
    temperature: float = 0.0
    max_concurrency: int = 8  # requests in flight
    timeout_s: float = 60.0  # per attempt
    max_attempts: int = 5  # attempts per request (timeouts, connection errors, 5xx, 408, 429 retried)
    backoff_s: float = 1.0  # wait before the 2nd attempt, doubling (at most 30 s)

    def __post_init__(self) -> None:
        if self.parser not in PARSERS:
            raise ValueError(f"reward.judge.parser={self.parser!r}: expected one of {', '.join(PARSERS)}")
        if not self.min_score < self.max_score:
            raise ValueError(
                f"reward.judge.min_score={self.min_score} must be below max_score={self.max_score}"
            )
        for key in ("top_logprobs", "max_tokens"):
            if getattr(self, key) <= 0:
                raise ValueError(f"reward.judge.{key}={getattr(self, key)!r} must be > 0")
        if self.temperature < 0:
            raise ValueError(f"reward.judge.temperature={self.temperature} must be >= 0")
        check_policy(self, "reward.judge")


def check_template(template: str, where: str = "reward.judge") -> None:
    """{response} present, no placeholder beyond {prompt} {response} {reference}, none with a format spec."""
    try:
        fields = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise ValueError(f"{where}.template: {e} (write {{{{ and }}}} for literal braces)") from None
    for name, spec, conv in fields:
        if name not in PLACEHOLDERS or spec or conv:
            raise ValueError(
                f"{where}.template: unknown placeholder {{{name}{'!' + conv if conv else ''}"
                f"{':' + spec if spec else ''}}}; use {{prompt}}, {{response}}, {{reference}} "
                "(write {{ and }} for literal braces)"
            )
    if "response" not in {f for f, _, _ in fields}:
        raise ValueError(
            f"{where}.template has no {{response}} placeholder: the judge would not see what it grades"
        )


def judge_endpoint(cfg: JudgeConfig, where: str = "reward.judge") -> tuple[str, str]:
    """(base URL, route): `/v1/chat/completions`, or `/chat/completions` after a base that ends in /v1."""
    if not cfg.url:
        raise ValueError(
            f"{where}.url is not set: give the judge server's base URL, e.g. {where}.url=http://host:30000"
        )
    base = check_urls([cfg.url], where)[0].rstrip("/")
    return base, "/chat/completions" if base.endswith("/v1") else "/v1/chat/completions"


def check_judge(cfg: JudgeConfig, where: str = "reward.judge") -> None:
    judge_endpoint(cfg, where)
    check_template(cfg.template, where)
    check_key_file(cfg.api_key_file, where)


# ------------------------------------------------------------------ parsers: reply -> score in [0, 1] or None
def _scaled(x: float, cfg: JudgeConfig) -> float:
    return min(1.0, max(0.0, (x - cfg.min_score) / (cfg.max_score - cfg.min_score)))


def parse_number(reply: dict, cfg: JudgeConfig) -> float | None:
    found = NUMBER.findall(reply["content"])
    return _scaled(float(found[-1]), cfg) if found and math.isfinite(float(found[-1])) else None


def parse_boxed(reply: dict, cfg: JudgeConfig) -> float | None:
    box = (last_boxed(reply["content"]) or "").strip()
    return _scaled(float(box), cfg) if NUMBER.fullmatch(box) and math.isfinite(float(box)) else None


def _word(text: str) -> str:
    return text.strip().strip(string.punctuation + " ").lower()


def parse_yes_no(reply: dict, cfg: JudgeConfig) -> float | None:
    first = reply["content"].split(maxsplit=1)
    return {"yes": 1.0, "no": 0.0}.get(_word(first[0])) if first else None


def parse_yes_no_logprobs(reply: dict, cfg: JudgeConfig) -> float | None:
    p = {"yes": 0.0, "no": 0.0}
    for alt in reply["top"] or []:
        word = _word(str(alt.get("token", ""))) if isinstance(alt, dict) else ""
        if word in p and isinstance(alt.get("logprob"), (int, float)):
            p[word] += math.exp(alt["logprob"])
    total = p["yes"] + p["no"]
    return p["yes"] / total if total > 0 else None


PARSERS: dict[str, Callable[[dict, JudgeConfig], float | None]] = {
    "number": parse_number,
    "boxed": parse_boxed,
    "yes_no": parse_yes_no,
    "yes_no_logprobs": parse_yes_no_logprobs,
}


def read_reply(body: Any) -> dict | None:
    """ChatCompletionResponse -> {"content": str, "top": the first token's top_logprobs or None}; None when it
    has no `choices[0].message`."""
    try:
        choice = body["choices"][0]
        content = choice["message"].get("content")
    except (KeyError, IndexError, TypeError, AttributeError):
        return None
    try:
        top = choice["logprobs"]["content"][0]["top_logprobs"]
    except (KeyError, IndexError, TypeError):
        top = None
    return {
        "content": content if isinstance(content, str) else "",
        "top": top if isinstance(top, list) else None,
    }


class JudgeReward:
    """Asks the judge about every sample; see the module docstring."""

    def __init__(self, cfg: JudgeConfig, where: str = "reward.judge") -> None:
        check_judge(cfg, where)
        self.cfg = cfg
        self.base, self.route = judge_endpoint(cfg, where)
        self._client = HttpClient([self.base], policy_of(cfg), cfg.api_key_file, name="judge")
        self._counts: Counter = Counter()

    def request(self, prompt: Any, response: str, reference: str) -> dict:
        """The body of one judge request (an OpenAI ChatCompletionRequest)."""
        c = self.cfg
        user = c.template.format(prompt=prompt_plain(prompt), response=response, reference=reference)
        messages = ([{"role": "system", "content": c.system}] if c.system else []) + [
            {"role": "user", "content": user}
        ]
        body: dict[str, Any] = {
            "model": c.model,
            "messages": messages,
            "max_tokens": c.max_tokens,
            "temperature": c.temperature,
        }
        if c.parser == "yes_no_logprobs":
            body.update(logprobs=True, top_logprobs=c.top_logprobs)
        return body

    def score(
        self, responses: list[str], answers: list[str], records: list[dict] | None = None
    ) -> list[RewardResult]:
        check_lengths(responses, answers, records)
        records = records if records is not None else [{} for _ in responses]
        bodies = [
            self.request(r.get("prompt"), resp or "", "" if a is None else str(a))
            for r, resp, a in zip(records, responses, answers)
        ]
        keys = [json.dumps(b, sort_keys=True) for b in bodies]
        first = dict(zip(reversed(keys), reversed(bodies)))  # key -> its body (one of the identical ones)
        unique = list(dict.fromkeys(keys))
        index = {k: i for i, k in enumerate(unique)}
        outcomes = self._client.post_all([first[k] for k in unique], lambda k, b: read_reply(b), self.route)
        parse = PARSERS[self.cfg.parser]
        results, bad_reply = [], None
        for k in keys:
            o = outcomes[index[k]]
            value = parse(o.value, self.cfg) if o.value is not None else None
            if o.value is None:
                results.append(RewardResult(0.0, False, f"judge_error:{o.kind}", None))
            elif value is None:
                bad_reply = bad_reply if bad_reply is not None else o.value["content"]
                results.append(RewardResult(0.0, False, PARSE_ERROR, None))
            else:
                results.append(RewardResult(value, value >= 0.5, OK, None))
        self._tally(results, outcomes, len(keys) - len(unique), bad_reply)
        return results

    def _tally(self, results: list[RewardResult], outcomes: list, hits: int, bad_reply: str | None) -> None:
        count_outcomes(self._counts, "reward_judge", outcomes)
        reasons = Counter(r.reason for r in results if r.reason != OK)
        self._counts.update(
            reward_judge_cache_hits=hits,
            reward_judge_parse_failures=reasons[PARSE_ERROR],
            reward_judge_errors=sum(n for r, n in reasons.items() if r != PARSE_ERROR),
        )
        if reasons:
            shown = "" if bad_reply is None else f"; an unreadable reply began {bad_reply[:80]!r}"
            logger.warning(
                "judge: %d of %d samples scored 0 (%s)%s",
                sum(reasons.values()),
                len(results),
                ", ".join(f"{k}={v}" for k, v in sorted(reasons.items())),
                shown,
            )

    def metrics(self) -> dict[str, float]:
        """Counts since the last call (the trainer reads them once per scored round)."""
        out = {
            f"reward_judge_{k}": float(self._counts[f"reward_judge_{k}"])
            for k in ("requests", "requests_failed", "retries", "cache_hits", "parse_failures", "errors")
        }
        self._counts.clear()
        return out

    def describe(self) -> str:
        c = self.cfg
        scale = f" [{c.min_score:g}, {c.max_score:g}] -> [0, 1]" if c.parser in ("number", "boxed") else ""
        top = f", top_logprobs={c.top_logprobs}" if c.parser == "yes_no_logprobs" else ""
        return (
            f"judge {shown_url(self.base + self.route)} (model={c.model}, parser={c.parser}{scale}{top}, "
            f"max_tokens={c.max_tokens}, temperature={c.temperature:g}, max_concurrency={c.max_concurrency}, "
            f"timeout_s={c.timeout_s:g} per attempt, max_attempts={c.max_attempts}, backoff_s={c.backoff_s:g}, "
            f"api key: {'from api_key_file' if c.api_key_file else 'none'})"
        )

    def close(self) -> None:
        self._client.close()


@register_reward("judge", JudgeConfig, check=check_judge)
def build_judge(options: dict[str, Any]) -> JudgeReward:
    return JudgeReward(config_from_dict(JudgeConfig, options, "reward.judge"))
