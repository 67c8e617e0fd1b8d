"""Compute accounting for a run: cumulative FLOPs and wall-clock, written with every eval record so scaling
fits can use `--x flops` or `--x hours` (ScaleRL plots accuracy against compute, not against updates).

FLOPs per token follow Kaplan et al. (2020): a forward pass costs 2N + 2 * n_layer * n_ctx * d_attn, where N is
the non-embedding parameter count and n_ctx the number of positions the token attends to (causal: its position
+ 1); a training step (forward + backward) costs 3x that. Per sequence of T tokens the attention term sums to
2 * n_layer * d_attn * T(T+1)/2. Generation counts prompt + response tokens once per sample (prefill is not shared
between a prompt's n samples in this accounting), scoring passes (old/ref/proximal log-probs) count one forward
over the whole sequence, and every trained sequence counts one forward + backward. Evaluation is not counted
(it is not training compute).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelFlops:
    non_embedding_params: int
    num_layers: int
    attn_dim: int  # n_heads * head_dim (the width attention scores are computed in)

    def forward(self, lengths: list[tuple[int, int]]) -> float:
        """One forward pass over sequences given as (prompt_len, response_len)."""
        total = 0.0
        for p, r in lengths:
            t = p + r
            total += 2.0 * self.non_embedding_params * t + 2.0 * self.num_layers * self.attn_dim * t * (t + 1) / 2
        return total


def model_flops(hf_dir: str | Path) -> ModelFlops:
    """Exact non-embedding parameter count of the HF architecture, counted on the meta device (no weights are
    read or allocated), so any family transformers knows is counted the same way."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(hf_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    emb = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
           for p in m.parameters()}
    n = sum(p.numel() for p in model.parameters() if id(p) not in emb)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return ModelFlops(int(n), int(cfg.num_hidden_layers), int(heads * head_dim))


@dataclass
class ComputeState:
    flops_train: float = 0.0  # forward + backward of trained sequences
    flops_generate: float = 0.0  # rollout generation
    flops_score: float = 0.0  # extra forward passes: old/ref/proximal log-probs
    tokens_generated: float = 0.0
    tokens_trained: float = 0.0  # prompt + response tokens of trained sequences (the speed summary's train tok/s)
    wallclock_s: float = 0.0  # cumulative over restarts, held-out evaluation excluded
    eval_s: float = 0.0  # held-out evaluation time (excluded above: it is not training cost)
    cpu_s: float = 0.0  # this process's CPU-seconds (all threads), cumulative, held-out evaluation excluded
    eval_cpu_s: float = 0.0  # CPU-seconds spent in held-out evaluation


class ComputeMeter:
    """Rank 0 keeps one; `state_dict` goes into checkpoints so a resumed run keeps counting from where it was."""

    def __init__(self, flops: ModelFlops, world_size: int = 1, on_gpu: bool = False) -> None:
        self.flops, self.world_size, self.on_gpu = flops, world_size, on_gpu
        self.state = ComputeState()
        self._t0 = time.perf_counter()
        self._c0 = time.process_time()

    def add_round(self, lengths: list[tuple[int, int]], score_passes: int) -> None:
        """One rollout round: its samples were generated once, scored by `score_passes` extra forwards, and each
        trained once (forward + backward)."""
        fwd = self.flops.forward(lengths)
        self.state.flops_generate += fwd
        self.state.flops_score += score_passes * fwd
        self.state.flops_train += 3.0 * fwd
        self.state.tokens_generated += float(sum(r for _, r in lengths))
        self.state.tokens_trained += float(sum(p + r for p, r in lengths))

    def skip_training(self, lengths: list[tuple[int, int]]) -> None:
        """Sequences of a counted round that the update left out of the forward/backward (their gradient was
        exactly zero, `trainer.skip_inert_rows`): not trained, so neither their FLOPs nor their tokens count."""
        self.state.flops_train -= 3.0 * self.flops.forward(lengths)
        self.state.tokens_trained -= float(sum(p + r for p, r in lengths))

    def add_eval_time(self, seconds: float, cpu_seconds: float = 0.0) -> None:
        self.state.eval_s += seconds
        self.state.wallclock_s -= seconds
        self.state.eval_cpu_s += cpu_seconds
        self.state.cpu_s -= cpu_seconds

    def record(self) -> dict[str, float]:
        """`wallclock_s` excludes held-out evaluation, so `--x hours` compares arms that evaluate at different
        rates fairly; `wallclock_total_s` includes it. `cpu_s` is the same for this process's CPU time: on a shared
        machine wall-clock depends on the load, CPU-seconds much less, so comparisons of arms report both (with
        `loadavg_1m` at the record)."""
        s = self.state
        wall = s.wallclock_s + time.perf_counter() - self._t0
        cpu = s.cpu_s + time.process_time() - self._c0
        out = {"flops": s.flops_train + s.flops_generate + s.flops_score, "flops_train": s.flops_train,
               "flops_generate": s.flops_generate, "flops_score": s.flops_score,
               "tokens_generated": s.tokens_generated, "tokens_trained": s.tokens_trained, "wallclock_s": wall, "wallclock_total_s": wall + s.eval_s,
               "cpu_s": cpu, "cpu_total_s": cpu + s.eval_cpu_s, "loadavg_1m": _loadavg()}
        if self.on_gpu:
            out["gpu_hours"] = wall * self.world_size / 3600.0
        return out

    def state_dict(self) -> dict[str, float]:
        d = asdict(self.state)
        rec = self.record()
        d["wallclock_s"], d["cpu_s"] = rec["wallclock_s"], rec["cpu_s"]
        return d

    def load_state_dict(self, d: dict[str, float]) -> None:
        self.state = ComputeState(**{k: float(v) for k, v in d.items() if k in ComputeState.__dataclass_fields__})
        self._t0 = time.perf_counter()
        self._c0 = time.process_time()


def _loadavg() -> float:
    try:
        return float(os.getloadavg()[0])
    except OSError:  # not available on every platform
        return float("nan")
