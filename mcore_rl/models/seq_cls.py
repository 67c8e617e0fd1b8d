"""HF `*ForSequenceClassification` models (reward models): a causal-LM family's decoder plus a score head.

transformers builds these for Llama, Mistral, Qwen2, Qwen3 and their MoE variants as one generic class (`GenericForSequenceClassification`
in `modeling_layers.py`): the decoder (`model.*`, the causal LM's names), its final norm, then `score` (a bias-free
Linear [num_labels, hidden]) applied at one token per row. So the causal family's adapter maps every decoder tensor
unchanged, and the Megatron model's output layer carries the score head instead of the LM head (canonical name
`output_layer.weight` <-> HF `score.weight`): one mapping for the trainer's reward model and the converter.

Which token HF scores (mirrored by `score_index`): the rightmost token that is not `pad_token_id`, found as
`argmax(arange(L) * (ids != pad))`, so a row of pad tokens only scores position 0; without a pad token, the last.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from mcore_rl.models.base import FAMILIES, ModelArgs, ModelFamily
from mcore_rl.models.fields import Field, mapped

HEAD = "output_layer.weight"  # canonical Megatron name of the score head
HF_HEAD = "score.weight"
# HF sequence-classification architecture -> the causal-LM family whose decoder it shares (same math, same names)
SEQ_CLS: dict[str, str] = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
    "Qwen2MoeForSequenceClassification": "Qwen2MoeForCausalLM",
    "Qwen3MoeForSequenceClassification": "Qwen3MoeForCausalLM",
}


def is_seq_cls(hf: dict[str, Any]) -> bool:
    """Whether an HF config names a sequence-classification (reward) model, supported or not."""
    return any(
        str(a).endswith(("ForSequenceClassification", "ForRewardModel"))
        for a in hf.get("architectures") or []
    )


def num_labels(hf: dict[str, Any]) -> int:
    """HF's `PretrainedConfig.num_labels`: the explicit field, else the size of `id2label`, else HF's default 2."""
    return int(hf.get("num_labels") or len(hf.get("id2label") or {}) or 2)


def score_index(row: Sequence[int], pad_id: int | None) -> int:
    """The position HF's sequence classifier reads in `row`: its last non-pad token (0 if every token is pad;
    the last token when the model has no pad token). A pad token inside the row counts as pad, as in HF."""
    if pad_id is None:
        return len(row) - 1
    return max((i for i, t in enumerate(row) if t != pad_id), default=0)


def _num_labels_check(value: Any, hf: dict[str, Any]) -> str | None:
    return None if isinstance(value, int) and value >= 1 else "num_labels must be a positive integer"


class ScoreFamily(ModelFamily):
    """A sequence classifier over `base`'s decoder: every name maps as in `base`; the output layer is the score
    head. `args.tie_word_embeddings` is False (there is no LM head to tie) and `args.num_labels` is set."""

    def __init__(self, base: ModelFamily, architecture: str):
        self.base = base
        self.architectures = (architecture,)
        self.qkv_bias, self.qk_norm = base.qkv_bias, base.qk_norm

    def fields(self) -> dict[str, Field]:
        return {**self.base.fields(), "num_labels": mapped(_num_labels_check)}

    def check_config(self, hf: dict[str, Any]) -> None:
        from mcore_rl.models.fields import check_fields

        check_fields(self.architectures[0], hf, self.fields())

    def args(self, hf: dict[str, Any]) -> ModelArgs:
        self.check_config(hf)
        causal = {k: v for k, v in hf.items() if k != "num_labels"}  # the base family does not know the field
        a = self.base.args({**causal, "architectures": [self.architectures[0]]})
        return dataclasses.replace(a, tie_word_embeddings=False, num_labels=num_labels(hf))

    def moe_args(self, hf: dict[str, Any]):
        return self.base.moe_args(hf)

    def mcore_names(self, a: ModelArgs) -> list[str]:
        return self.base.mcore_names(a)  # untied: ends with output_layer.weight, here the score head

    def hf_sources(self, a: ModelArgs, name: str) -> list[str]:
        return [HF_HEAD] if name == HEAD else self.base.hf_sources(a, name)

    def to_mcore(self, a: ModelArgs, name: str, get_hf: Callable[[str], torch.Tensor]) -> torch.Tensor:
        return get_hf(HF_HEAD) if name == HEAD else self.base.to_mcore(a, name, get_hf)

    def to_hf(self, a: ModelArgs, name: str, full: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if name == HEAD:
            yield HF_HEAD, full
        else:
            yield from self.base.to_hf(a, name, full)


def score_family_for(hf: dict[str, Any]) -> ScoreFamily:
    """The adapter of a sequence-classification config; any other architecture is refused in one line."""
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in SEQ_CLS:
            return ScoreFamily(FAMILIES.get(SEQ_CLS[arch])(), arch)
    raise ValueError(
        f"architecture {archs or hf.get('model_type')!r} is not a supported reward model; supported: "
        f"{', '.join(SEQ_CLS)} (transformers' generic score head on the last non-pad token)"
    )


def model_family(hf: dict[str, Any]) -> ModelFamily:
    """A causal LM's family, or the score family of a sequence classifier (the converter takes either)."""
    from mcore_rl.models.base import family_for

    return score_family_for(hf) if is_seq_cls(hf) else family_for(hf)
