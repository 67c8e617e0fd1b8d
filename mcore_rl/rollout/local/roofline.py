"""The decode roofline of the embedded engine: what the hardware allows for the batches the engine really ran.

A decode step of `rows` rows over `kv_len` cache columns must (a) do its FLOPs, 2 per matmul weight per row plus
the attention over the cache, and (b) stream every weight once plus each row's K/V. The step can be no faster
than the slower of the two at the machine's measured matmul rate and memory bandwidth: tokens/s = min(compute
bound, streaming bound). Summed over the engine's own recorded steps (EngineStats.batch_sizes / kv_lengths), that
is the number `benchmarks/rollout_engine.py` sets the engine's decode against, measured in the same run.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from mcore_rl.policy.precision import Rate, time_matmul


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_of(fn, device: torch.device, amount: float, repeats: int) -> Rate:
    """Best-of-`repeats` rate of `amount` units per call: other processes only ever slow a run down."""
    fn()
    _sync(device)
    wall = cpu = 0.0
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        _sync(device)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        wall, cpu = max(wall, amount / dt), max(cpu, amount / max(dc, 1e-9))
    return Rate(wall, cpu)


def matmul_gflops(device: torch.device, dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> Rate:
    """GFLOP/s of a square `torch.mm` (the machine's achievable matmul peak in this dtype), through the
    project's one matmul probe (`policy/precision.time_matmul`)."""
    return time_matmul(dtype, size, size, size, device, min_time=0.0, repeats=repeats)


def bandwidth_gbs(device: torch.device, nbytes: int = 256 << 20, repeats: int = 5) -> Rate:
    """Read bandwidth in GB/s: one reduction over a buffer far larger than the caches (what a decode step does
    to the weights: read each once)."""
    x = torch.ones(nbytes // 4, device=device)
    return _best_of(lambda: x.sum(), device, nbytes / 1e9, repeats)


@dataclass(frozen=True)
class DecodeCost:
    """Per-step work of a decoder LM: matmul weights (the LM head included, input embedding lookup excluded); for a
    mixture of experts, the expert weights apart (`expert_params`: one expert's, summed over layers)."""

    matmul_params: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    bytes_per_value: int
    num_experts: int = 0
    top_k: int = 0
    expert_params: int = 0

    @classmethod
    def of(cls, model: torch.nn.Module) -> DecodeCost:
        cfg = model.config.get_text_config(decoder=True)
        head = model.get_output_embeddings().weight
        skip = {id(head), id(model.get_input_embeddings().weight)}
        # experts: whatever lives under `.experts.` (transformers 5 keeps them as 3-D [E, out, in] tensors; older
        # versions as a list of 2-D ones); the router and shared experts are dense weights
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and p.dim() >= 2)
        mats = sum(p.numel() for n, p in model.named_parameters()
                   if p.dim() == 2 and id(p) not in skip and ".experts." not in n)
        n_exp = int(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0)
        top_k = int(getattr(cfg, "num_experts_per_tok", None) or 0) if n_exp else 0
        q_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // q_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or q_heads
        return cls(mats + head.numel(), cfg.num_hidden_layers, q_heads, kv_heads, head_dim, head.element_size(),
                   n_exp, top_k, experts // n_exp if n_exp else 0)

    def experts_read(self, rows: int) -> float:
        """Experts a step reads, per layer: the expected number of distinct experts `rows` rows pick with top-k
        routing spread evenly (all of them, soon, as the batch grows)."""
        if not self.num_experts:
            return 0.0
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** rows)

    def flops(self, rows: int, kv_len: int) -> float:
        """2 per weight a row uses (the dense ones and its top-k experts), plus QK^T and PV over kv_len columns in
        every layer."""
        attention = 4 * self.layers * self.q_heads * self.head_dim * kv_len
        return rows * (2.0 * (self.matmul_params + self.top_k * self.expert_params) + attention)

    def bytes(self, rows: int, kv_len: int) -> float:
        """Every dense weight and every expert the step uses once, plus each row's K and V over kv_len columns in
        every layer."""
        kv = 2 * self.layers * self.kv_heads * self.head_dim * kv_len * rows
        return (self.matmul_params + self.experts_read(rows) * self.expert_params + kv) * self.bytes_per_value


@dataclass(frozen=True)
class Roofline:
    """Lower bounds on the time of a sequence of decode steps; tokens = rows summed over the steps."""

    tokens: int
    compute_s: float  # every step at the matmul rate
    memory_s: float  # every step at the bandwidth
    bound_s: float  # per step the slower of the two, summed

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.bound_s if self.bound_s else 0.0


def decode_roofline(
    cost: DecodeCost, steps: Iterable[tuple[int, int]], gflops: float, gbs: float
) -> Roofline:
    """Roofline of decode steps given as (rows, kv_len) pairs at `gflops` GFLOP/s and `gbs` GB/s."""
    tokens, compute, memory, bound = 0, 0.0, 0.0, 0.0
    for rows, kv_len in steps:
        c = cost.flops(rows, kv_len) / (gflops * 1e9)
        m = cost.bytes(rows, kv_len) / (gbs * 1e9)
        tokens, compute, memory, bound = tokens + rows, compute + c, memory + m, bound + max(c, m)
    return Roofline(tokens, compute, memory, bound)
