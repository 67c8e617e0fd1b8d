"""The model behind `mcore-rl-serve --is-embedding`: an HF `*ForSequenceClassification` folder scored as SGLang
scores it (last-token pooling), batched on one worker thread.

Why last token and not HF's pooling: SGLang's classification models (e.g. `LlamaForSequenceClassification` in
sglang/srt/models/llama_reward.py) pool with `PoolingType.LAST`, the row's final position, whatever token it is.
HF picks the last token that is not `pad_token_id`, which is a different position when a row ends with the pad id
(SmolLM2's pad is `<|im_end|>`, the end of every chat turn). A reward served here must equal SGLang's, so the trunk
runs on right-padded rows and the score head reads each row's own last position.

Requests from concurrent HTTP calls queue up; the worker takes everything queued, sorts the rows by length (less
padding) and runs them in chunks of `max_batch_size`, so the event loop never waits on a forward.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from pathlib import Path

import torch

from mcore_rl.dtypes import SHORT_OR_LONG, long_name
from mcore_rl.rollout.local.engine import resolve_device
from mcore_rl.rollout.local.rows import eos_ids

log = logging.getLogger("mcore_rl.serve")


class RewardModelServer:
    """Engine-shaped holder of a sequence-classification model: `submit(rows)` -> Future[list[list[float]]]
    (one logit vector per token row, order kept). Thread-safe."""

    is_generation = False

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        num_threads: int | None = None,
        max_batch_size: int = 64,
        weight_version: int = 0,
    ) -> None:
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        if num_threads:
            torch.set_num_threads(int(num_threads))
        if not Path(model_path, "config.json").is_file():
            raise FileNotFoundError(f"--model-path {model_path} is not an HF folder (no config.json)")
        if dtype != "auto" and dtype not in SHORT_OR_LONG:
            raise ValueError(f"--dtype={dtype!r}: expected auto, float32, bfloat16 or float16")
        torch_dtype = getattr(torch, "float32" if dtype == "auto" else long_name(dtype))
        archs = list(getattr(AutoConfig.from_pretrained(model_path), "architectures", None) or [])
        # a causal-LM folder would load too, under a randomly initialised head: refuse it
        if not any(a.endswith("ForSequenceClassification") for a in archs):
            raise ValueError(
                f"--is-embedding: {model_path} holds {archs or 'no architectures'}, not a *ForSequenceClassification"
                " model"
            )
        self.model_path = str(model_path)
        self.device = resolve_device(device)
        model = AutoModelForSequenceClassification.from_pretrained(
            model_path, dtype=torch_dtype, attn_implementation="sdpa"
        )
        self.model = model.to(self.device).eval()
        self._trunk = self.model.base_model
        self._head = getattr(self.model, "score", None)
        if self._trunk is self.model or not isinstance(self._head, torch.nn.Module):
            raise ValueError(
                f"--is-embedding: {type(self.model).__name__} has no trunk + `score` head; mcore-rl-serve serves "
                "decoder *ForSequenceClassification models (Llama, Qwen2/3, Mistral, Gemma, ...)"
            )
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        except (OSError, ValueError, TypeError):
            self.tokenizer = None
        cfg = self.model.config
        self.context_len = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        self.vocab_size = int(cfg.vocab_size)
        self.eos_ids = eos_ids(self.model)
        self.max_batch_size = int(max_batch_size)
        self.weight_version = int(weight_version)
        self._jobs: deque[tuple[list[list[int]], Future]] = deque()
        self._cv = threading.Condition()
        self._closing = False
        self._worker = threading.Thread(target=self._loop, name="reward-model-server", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ engine surface the routes use
    def submit(self, rows: list[list[int]]) -> Future:
        fut: Future = Future()
        with self._cv:
            if self._closing:
                raise RuntimeError("server is closing")
            self._jobs.append((rows, fut))
            self._cv.notify_all()
        return fut

    def health(self) -> bool:
        return self._worker.is_alive() and not self._closing

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._worker.join(timeout=60)
        for _, fut in self._jobs:
            if not fut.done():
                fut.set_exception(RuntimeError("server closed"))
        self._jobs.clear()

    # ------------------------------------------------------------------ worker
    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._jobs or self._closing)
                if self._closing:
                    return
                jobs = list(self._jobs)
                self._jobs.clear()
            rows = [r for rs, _ in jobs for r in rs]
            try:
                scores = self.score(rows)
            except Exception as exc:  # fail these requests, keep serving
                log.exception("reward model forward failed")
                for _, fut in jobs:
                    fut.set_exception(exc)
                continue
            at = 0
            for rs, fut in jobs:
                fut.set_result(scores[at : at + len(rs)])
                at += len(rs)

    @torch.inference_mode()
    def score(self, rows: list[list[int]]) -> list[list[float]]:
        """Head logits at each row's last token, in row order; rows run length-sorted in chunks."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        out: list[list[float]] = [[] for _ in rows]
        for start in range(0, len(order), self.max_batch_size):
            chunk = order[start : start + self.max_batch_size]
            for i, logits in zip(chunk, self._forward([rows[i] for i in chunk])):
                out[i] = logits
        return out

    def _forward(self, rows: list[list[int]]) -> list[list[float]]:
        width = max(map(len, rows))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        # right padding: under causal attention a row's real tokens never see its pads
        hidden = self._trunk(input_ids=ids, attention_mask=mask).last_hidden_state
        last = hidden[torch.arange(len(rows), device=self.device), mask.sum(dim=1) - 1]
        return self._head(last).float().tolist()
