"""In-process rollout engine on `transformers` (CPU or GPU): the default engine on one machine.

One stepping thread at a time owns the model and runs a continuous batch (the worker, or a caller blocked in
`wait`: stepping.py): requests submitted from any thread queue up and join the running batch between decode
steps (their prompts are prefilled and merged into the KV cache), rows that finish leave it at once (a row from
the tail takes the slot), and all-padding columns are cropped, so later steps get cheaper.
Aborts, pauses and weight updates from other threads take effect between decode steps; every token records the
weight version that produced it.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from pathlib import Path

import torch

from mcore_rl.dtypes import SHORT_OR_LONG, long_name
from mcore_rl.rollout.local.decode_batch import DecodeBatch
from mcore_rl.rollout.local.engine_stats import EngineStats
from mcore_rl.rollout.local.kv_cache import check_full_attention
from mcore_rl.rollout.local.rows import Row, eos_ids, make_row, to_sample
from mcore_rl.rollout.local.stepping import Stepper
from mcore_rl.rollout.local.weight_layout import choose as choose_layout
from mcore_rl.rollout.local.weights import load_named_tensors
from mcore_rl.rollout.protocol import (
    PAUSE_MODES,
    GenerationRequest,
    PauseMode,
    Sample,
    expand_requests,
    register_engine,
)
from mcore_rl.rollout.weight_sync.disk_sync import iter_safetensors

log = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    """`auto` = the trainer's device: cuda:<LOCAL_RANK> when CUDA is up (the rank that owns the engine holds
    that GPU), else cpu. Why not cpu always: on a GPU node a CPU engine decodes orders of magnitude slower."""
    if device != "auto":
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


@register_engine("local")
class LocalEngine(Stepper):
    """RolloutEngine over an HF causal LM folder. Thread-safe; `submit` returns one Future per sample. Which
    thread runs its steps (the worker, or a caller blocked in `wait`): stepping.py."""
    def __init__(
        self,
        model_path: str,
        *,
        device: str = "auto",
        dtype: str = "float32",
        num_threads: int | None = None,
        max_batch_size: int = 64,
        seed: int = 0,
        weight_version: int = 0,
        return_text: bool = True,
        fast_decode: bool = True,
        fused_forward: bool = True,
        weight_layout: str = "auto",
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if num_threads:
            torch.set_num_threads(int(num_threads))
        if not Path(model_path, "config.json").is_file():
            raise FileNotFoundError(f"model_path {model_path} is not an HF folder (no config.json)")
        self.model_path = str(model_path)
        self.device = resolve_device(device)
        if dtype != "auto" and dtype not in SHORT_OR_LONG:
            raise ValueError(f"rollout.dtype={dtype!r}: expected auto, float32, bfloat16 or float16")
        name = "float32" if dtype == "auto" else long_name(dtype)  # standalone: fp32 (a run resolves auto first)
        torch_dtype = getattr(torch, name)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype, attn_implementation="sdpa")
        self.model = model.to(self.device).eval()
        check_full_attention(self.model.config)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        except (OSError, ValueError, TypeError):
            self.tokenizer = None
        self._params = dict(self.model.state_dict(keep_vars=True))
        text_config = self.model.config.get_text_config(decoder=True)
        num_layers, self._vocab = text_config.num_hidden_layers, text_config.vocab_size
        self._max_len = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self._eos = eos_ids(self.model)
        self.max_batch_size = int(max_batch_size)
        self.return_text = return_text
        self._seed_rng = random.Random(seed)
        self._version = int(weight_version)
        self.interrupt_on_update = False  # see set_interrupt_on_update
        self.stats = EngineStats()
        self._meter = None  # DecodeMeter, made at the first speed_metrics() call (False: not meterable)
        self._init_stepping()
        pad = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0
        self._batch = DecodeBatch(self.model, num_layers, pad, self.device)
        self.set_weight_layout(weight_layout)
        self.set_fast_decode(fast_decode, fused_forward)
        self._worker.start()

    def set_fast_decode(self, sampling: bool = True, forward: bool = True) -> bool:
        """sampling: index-free sampling (token_sampler.py; bitwise the same tokens and log-probs as False).
        forward: decode steps through our own llama-family forward (decode_forward.py); False, or a model it does
        not cover exactly: the HF forward (the reference). Between steps; returns whether `forward` is on."""
        with self._hold_model():
            self._index_free = bool(sampling)
            reason = self._batch.use_fused(forward, self.weight_layout.in_major)
        if forward and reason:
            log.info("local engine: HF forward for decode steps (%s)", reason)
        return reason is None

    def set_weight_layout(self, layout: str) -> None:
        """Store the decode step's layer weights [out, in] (`out`) or [in, out] (`in`), or measure which is faster
        here (`auto`, weight_layout.py): at start, and between steps, e.g. to time both layouts in one process
        (benchmarks/rollout_engine.py). The choice is logged (a warning where it was measured or forced)."""
        with self._hold_model():
            self.weight_layout = choose_layout(self.model, layout, self.device, self.model.dtype)
            self._batch.set_layout(self.weight_layout.in_major)
        level = logging.WARNING if self.weight_layout.measured or layout != "auto" else logging.INFO
        log.log(level, "local engine: decode weights stored [%s] (%s)",
                "in, out" if self.weight_layout.in_major else "out, in", self.weight_layout.why)

    # ------------------------------------------------------------------ protocol
    @property
    def weight_version(self) -> int:
        return self._version

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Sample]:
        if not self._drives():
            return [f.result() for f in self.submit(requests)]
        with self._driving():  # from before the submit: the worker must not take the first step
            futures = self.submit(requests)
            self._drive(futures, None)
        return [f.result() for f in futures]

    def submit(self, requests: Sequence[GenerationRequest]) -> list[Future]:
        """Queue requests; one Future[Sample] per sample, request-major. Never blocks on generation."""
        rows = [self._make_row(req, j) for req, j in expand_requests(requests)]
        with self._cv:
            if self._closing:
                raise RuntimeError("engine is closed")
            if self._released:
                raise RuntimeError("engine memory is released; call resume_memory() before generate()")
            self._pending.extend(rows)
            self._handoff = time.monotonic()
            self._cv.notify_all()
        return [r.future for r in rows]

    def abort(self, rid: str | None = None) -> None:
        with self._cv:
            for row in itertools.chain(self._pending, list(self._admitting), list(self._batch.rows)):
                if rid is None or row.req.rid == rid:
                    row.abort_requested = True
            self._wake = True
            self._cv.notify_all()

    def pause(self, mode: PauseMode = "abort") -> None:
        """abort: in-flight samples return now (finish "abort"); in_place / retract: they wait, KV cache kept,
        and continue after resume() (tokens after a weight update carry the new version). New requests queue."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} not in {PAUSE_MODES}")
        with self._cv:
            self._paused = True
        if mode == "abort":
            self.abort(None)
            with self._cv:  # SGLang returns once the aborted requests are out
                self._cv.wait_for(lambda: not self._batch.rows and not self._admitting, timeout=60)
        with self._hold_model():  # returns once the in-flight decode step is done
            pass

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy HF-named tensors in place. Holds decoding for the whole stream, so no step sees half an update."""
        with self._hold_model():
            n = load_named_tensors(self._params, named_tensors)
            self._batch.refresh_fused()  # in-place copies land in the fused buffers; re-fuse re-pointed ones
            self._version = int(version)
            if self.interrupt_on_update:
                self._restart_in_flight()
        log.info("local engine: loaded %d tensors, weight_version=%d", n, version)

    def update_weights_from_disk(self, path: str, version: int) -> None:
        self.update_weights(iter_safetensors(path), version)

    def set_interrupt_on_update(self, enabled: bool = True) -> None:
        """Interrupt mode (old_logp_source=interrupt|old_logit_model): every weight update restarts the samples in
        flight from their prompt under the new weights (same seed), so each finished sample's tokens all carry one
        weight version. Costs the discarded tokens (stats.regenerated counts restarted samples)."""
        self.interrupt_on_update = bool(enabled)

    def _restart_in_flight(self) -> None:
        """Caller holds _model_lock (no decode step runs): rows with tokens go back to the queue's front."""
        rows = [r for r in self._batch.rows if r.finish is None]
        for row in rows:
            row.restart()
        self._batch.reset()
        with self._cv:
            self._pending.extendleft(reversed(rows))
            self._cv.notify_all()
        self.stats.regenerated += len(rows)

    def set_weight_version(self, version: int) -> None:
        """Re-tag without loading weights (SGLang's /update_weight_version)."""
        with self._hold_model():
            self._version = int(version)

    def release_memory(self) -> None:
        with self._cv:
            if self.num_running:
                raise RuntimeError(
                    f"release_memory() with {self.num_running} requests in flight; pause(mode='abort') first"
                )
            self._released = True
        with self._hold_model():
            if self.device.type == "cuda":
                self.model.to("cpu")
                torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        with self._hold_model():
            if self._released and self.device.type == "cuda":
                self.model.to(self.device)
                self._batch.refresh_fused()  # .to() re-pointed the parameters at new storage
        with self._cv:
            self._released = False
            self._cv.notify_all()

    def health(self) -> bool:
        return self._worker.is_alive() and not self._closing

    def speed_metrics(self) -> dict[str, float]:
        """Decode work since the last call against its decode roofline (rollout/local/decode_meter.py): the
        trainer logs it per round and the end-of-run speed summary sums it."""
        if self._meter is None:
            from mcore_rl.rollout.local.decode_meter import DecodeMeter
            from mcore_rl.rollout.local.roofline import DecodeCost

            try:
                self._meter = DecodeMeter(DecodeCost.of(self.model), self.device, self.model.dtype)
            except (AttributeError, TypeError, ValueError) as e:  # a model the cost formula does not read
                log.warning("engine decode roofline not metered for this model (%s: %s)", type(e).__name__, e)
                self._meter = False
        return self._meter.round_metrics(self.stats) if self._meter else {}

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._worker.join(timeout=60)
        err = RuntimeError("engine closed")
        for row in itertools.chain(self._pending, self._admitting, self._batch.rows):
            if not row.future.done():
                row.future.set_exception(err)
        self._pending.clear()
        self._batch.reset()

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def num_running(self) -> int:
        """Samples admitted or queued (SGLang refuses /flush_cache while this is > 0)."""
        return len(self._batch) + len(self._admitting) + len(self._pending)

    @property
    def paused(self) -> bool:
        return self._paused

    # ------------------------------------------------------------------ rows (rules in rows.py)
    def _make_row(self, req: GenerationRequest, j: int) -> Row:
        return make_row(req, j, eos=self._eos, max_len=self._max_len, vocab=self._vocab, seed_rng=self._seed_rng,
                        has_tokenizer=self.tokenizer is not None, model_path=self.model_path)  # fmt: skip

    def _to_sample(self, row: Row) -> Sample:
        return to_sample(row, self.tokenizer, self.return_text)
