"""Next-token logits of the last position: the decoder's hidden state times the LM head, shaped for the CPU GEMM.

Why not the model's own `lm_head(hidden)`: the head is the largest matrix of a small model (SmolLM2: 49152 x 576,
21% of the decode FLOPs) and a decode step multiplies it by a skinny [rows, hidden] matrix, where MKL's default
`x @ W^T` is far from the matmul rate. Measured on a 2-core AMD EPYC (1 thread, fp32, CPU time per call): with 8
rows, `W @ x^T` (stream W once, GEMV-like) 14.9 ms vs 24.5 ms; with 64 rows, column blocks of 1024 vocab entries
written into one output 54.6 ms vs 70.8 ms. Same products, regrouped: the logits agree to float rounding.
In bf16 and on CUDA the plain product is used. On a CPU whose decode weights are stored [in, out]
(weight_layout.py: where `auto` measured that family of skinny GEMMs faster) the head is the plain product too:
on the Intel Xeon without bf16 (2 threads, fp32, caches evicted between calls) plain `x @ W^T` took 8.8 / 9.1 /
12.0 / 19.9 ms at 4 / 16 / 36 / 64 rows against 11.1 / 11.8 / 13.4 / 20.9 regrouped
(`benchmarks/decode_gemms.py --streamed` times both). Models whose logits are anything but `lm_head(hidden)`
(scaled, soft-capped) are not listed in PLAIN_HEAD_MODELS and keep the model's own forward.
"""

from __future__ import annotations

import torch

from mcore_rl.compat.bf16_matmul import WideWeights, routed, wide_linear

# model_type -> the CausalLM's logits are exactly lm_head(last hidden state) (read in transformers' modeling files)
PLAIN_HEAD_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"})
SKINNY_ROWS = 16  # at or below: W @ x^T
VOCAB_BLOCK = 1024  # above: x @ W[block]^T per block of the vocabulary
# The dtypes whose CPU GEMMs pay for regrouping (the head's forms here, the decode layers' `W @ x^T` in
# decode_forward.linear): fp32 only. In bf16 (oneDNN, AMD EPYC with avx512_bf16, 1 thread) the plain product was
# as fast or faster: the head 9.0 vs 11.3 ms at 8 rows, 23.6 vs 25.8 ms at 64; a layer's 1-4 row GEMMs 0.38-0.44
# vs 0.66 ms.
REGROUP_DTYPES = (torch.float32,)


class LastLogits:
    """`logits(**model_kwargs)` -> [B, V] logits of the last position, through the decoder and our head."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        head = model.get_output_embeddings()
        plain = (
            model.config.model_type in PLAIN_HEAD_MODELS
            and isinstance(head, torch.nn.Linear)
            and head.bias is None
            and hasattr(model, "model")
        )
        self.head = head if plain else None  # the module, not its weight: weight updates copy in place
        self.regroup = True  # the CPU forms below (fp32); False: the plain product (weight_layout.py decides)
        self.wide = WideWeights(capacity=1)  # the head's fp32 copy for the fp32-GEMM bf16 route (compat/bf16_matmul.py)

    def __call__(self, **kwargs) -> torch.Tensor:
        if self.head is None:
            return self.model(**kwargs, logits_to_keep=1).logits[:, -1]
        return self.of(self.model.model(**kwargs).last_hidden_state[:, -1])

    def of(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of final hidden states [B, H] (a plain head only)."""
        if routed(hidden):
            return wide_linear(hidden, self.head.weight, None, self.wide)
        return head_logits(hidden, self.head.weight, self.regroup)


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, regroup: bool = True) -> torch.Tensor:
    """hidden [B, H] @ weight [V, H]^T, grouped for the CPU GEMM where `regroup` (see the module docstring)."""
    if not regroup or hidden.device.type != "cpu" or hidden.dtype not in REGROUP_DTYPES:
        return torch.nn.functional.linear(hidden, weight)
    rows, vocab = hidden.shape[0], weight.shape[0]
    if rows <= SKINNY_ROWS:
        return torch.mm(weight, hidden.t()).t().contiguous()
    out = hidden.new_empty(rows, vocab)
    for start in range(0, vocab, VOCAB_BLOCK):
        torch.mm(hidden, weight[start : start + VOCAB_BLOCK].t(), out=out[:, start : start + VOCAB_BLOCK])
    return out
