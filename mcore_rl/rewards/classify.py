"""`ClassifyScorer`: the TokenScorer of `reward.rm.placement=server`, over HTTP `/classify`.

The request and answer are SGLang 0.5.23's (`sglang/srt/entrypoints/http_server.py` route `/classify`, request class
`EmbeddingReqInput` in `sglang/srt/managers/io_struct.py`), which `mcore-rl-serve --is-embedding` serves too:
`POST {url}/classify` with `{"input_ids": [[...], ...]}` (a list of token lists is a batch: `is_single` is False when
`input_ids[0]` is a list), answered by a list with one `{"embedding": [logits...], "meta_info": {...}}` per row; the
score is `embedding[label]`. Rows go `batch_size` to a request through the shared client (http_client.py: retries
with backoff, the next URL on a retry, `max_concurrency`, the key header). A request that fails after its retries
leaves its rows NaN, with `last_errors[row] = "remote_error:<kind>"` for the reward to name; one warning line per
call, and request counts in `metrics()`.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import Any

from mcore_rl.rewards.http_client import HttpClient, count_outcomes, failure_summary, policy_of

logger = logging.getLogger(__name__)
ROUTE = "/classify"


def parse_classify(body: Any, n: int, label: int) -> list[float] | None:
    """SGLang's batch answer -> the `label` logit of each row (NaN for a non-finite one); None when malformed
    (not a list of n items each with an `embedding` list longer than `label`)."""
    if not isinstance(body, list) or len(body) != n:
        return None
    out = []
    for item in body:
        emb = item.get("embedding") if isinstance(item, dict) else None
        if not isinstance(emb, list) or len(emb) <= label or not isinstance(emb[label], (int, float)):
            return None
        x = float(emb[label])
        out.append(x if math.isfinite(x) else math.nan)
    return out


class ClassifyScorer:
    """POSTs token rows to `{url}/classify`; see the module docstring."""

    def __init__(self, urls: list[str], cfg: Any) -> None:
        self.urls, self.label, self.batch_size = list(urls), int(cfg.label), int(cfg.batch_size)
        self._client = HttpClient(self.urls, policy_of(cfg), cfg.api_key_file, name="rm")
        self._counts: Counter = Counter()
        self.last_errors: dict[int, str] = {}

    def score_ids(self, rows: list[list[int]]) -> list[float]:
        n = self.batch_size
        spans = [(i, min(i + n, len(rows))) for i in range(0, len(rows), n)]
        payloads = [{"input_ids": [list(map(int, r)) for r in rows[a:b]]} for a, b in spans]
        outcomes = self._client.post_all(
            payloads, lambda k, body: parse_classify(body, spans[k][1] - spans[k][0], self.label), ROUTE
        )
        out: list[float] = []
        self.last_errors = {}
        for (a, b), o in zip(spans, outcomes):
            if o.value is None:
                self.last_errors.update({i: f"remote_error:{o.kind}" for i in range(a, b)})
                out += [math.nan] * (b - a)
            else:
                out += o.value
        count_outcomes(self._counts, "reward_rm", outcomes)
        if line := failure_summary(outcomes, [b - a for a, b in spans]):
            logger.warning("rm reward (/classify): %s scored 0 (reason remote_error:<kind>)", line)
        return out

    def metrics(self) -> dict[str, float]:
        out = {
            k: float(self._counts[k])
            for k in ("reward_rm_requests", "reward_rm_requests_failed", "reward_rm_retries")
        }
        self._counts.clear()
        return out

    def close(self) -> None:
        self._client.close()
