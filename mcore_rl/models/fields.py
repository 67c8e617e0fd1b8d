"""Which HF config fields an adapter understands: mapped exactly, harmless, or accepted only at one value.

Why: a field that changes the model's math but is not mapped would silently fall back to a Megatron default, and
the policy would train a different network than the checkpoint describes. Every family declares its fields; any
field outside the declaration (or a declared field at a value we do not implement) is refused in one line, at
conversion and at training start, naming the field and its value.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class UnsupportedConfigError(ValueError):
    """One line: which field, which value, which adapter."""


Check = Callable[[Any, Mapping[str, Any]], str | None]  # (value, whole config) -> reason it is refused, or None


@dataclass(frozen=True)
class Field:
    """How an adapter treats one HF config field.

    kind: "mapped" (read by the adapter into Megatron's config), "harmless" (metadata, inference-only or init-only:
    no effect on the forward/backward math), or "fixed" (only the values in `allowed` are implemented).
    """

    kind: str
    allowed: tuple[Any, ...] = ()
    check: Check | None = None
    why: str = ""

    def refusal(self, value: Any, hf: Mapping[str, Any]) -> str | None:
        if self.kind == "fixed" and value not in self.allowed:
            why = f" ({self.why})" if self.why else ""
            return f"only {' or '.join(map(repr, self.allowed))} is implemented{why}"
        if self.check is not None:
            return self.check(value, hf)
        return None


def mapped(check: Check | None = None) -> Field:
    return Field("mapped", check=check)


def harmless(why: str = "") -> Field:
    return Field("harmless", why=why)


def fixed(*allowed: Any, why: str = "") -> Field:
    return Field("fixed", allowed=allowed, why=why)


# Metadata every HF config may carry (PretrainedConfig bookkeeping, tokenizer ids, inference switches).
_HARMLESS_PATTERN = re.compile(r"^_|_token_id$|_token_ids$")
COMMON_FIELDS: dict[str, Field] = {
    **{k: harmless("metadata") for k in (
        "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "id2label", "label2id",
        "problem_type", "return_dict", "output_hidden_states", "output_attentions", "use_cache",
        "tokenizer_class", "prefix", "task_specific_params", "finetuning_task", "name_or_path", "use_return_dict",
        "torchscript", "tf_legacy_loss", "use_bfloat16", "keys_to_ignore_at_inference")},
    "initializer_range": harmless("only used by random initialisation"),
    "chunk_size_feed_forward": harmless("chunking the MLP over the sequence gives the same values"),
    "is_encoder_decoder": fixed(False),
    "is_decoder": fixed(False, True, why="a causal LM is a decoder either way"),
    "add_cross_attention": fixed(False),
    "tie_encoder_decoder": fixed(False),
    "pruned_heads": fixed({}),
}


def _rope_check(value: Any, hf: Mapping[str, Any]) -> str | None:
    """Every RoPE type of models/rope.py with its own keys; anything else is refused."""
    from mcore_rl.models.rope import rope_refusal

    return rope_refusal(hf) if value else None


def _sliding_window_check(value: Any, hf: Mapping[str, Any]) -> str | None:
    return None if not hf.get("use_sliding_window", False) or value is None else "sliding-window attention"


def _full_attention_only(value: Any, hf: Mapping[str, Any]) -> str | None:
    bad = sorted({t for t in (value or []) if t != "full_attention"})
    return f"layer types {bad} are not implemented (full_attention only)" if bad else None


def _activation_check(value: Any, hf: Mapping[str, Any]) -> str | None:
    from mcore_rl.models.activations import activation_refusal

    return activation_refusal(value, hf)


# Fields every Llama-like decoder (Llama, Qwen2, Qwen3, Qwen3-MoE) maps the same way.
DECODER_FIELDS: dict[str, Field] = {
    **{k: mapped() for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
        "rope_theta")},
    "rope_parameters": mapped(_rope_check),
    "rope_scaling": mapped(_rope_check),
    "hidden_act": mapped(_activation_check),
    "attention_dropout": fixed(0, 0.0, why="Megatron's policy runs without dropout"),
    "attention_bias": fixed(False, why="HF also puts a bias on o_proj, which Megatron's GPT has not"),
    "pretraining_tp": harmless("HF no longer splits the matmuls by it"),
    "use_sliding_window": fixed(False),
    "sliding_window": mapped(_sliding_window_check),
    "max_window_layers": harmless("only read with use_sliding_window=true"),
    "layer_types": mapped(_full_attention_only),
}


def check_fields(architecture: str, hf: Mapping[str, Any], declared: Mapping[str, Field]) -> None:
    """Raise UnsupportedConfigError on the first field the declaration does not cover or refuses."""
    for key in sorted(hf):
        value = hf[key]
        spec = declared.get(key)
        if spec is None:
            if _HARMLESS_PATTERN.search(key):
                continue
            raise UnsupportedConfigError(
                f"config field {key}={value!r} is unknown to the {architecture} adapter (it may change the "
                f"model's math); refusing rather than ignoring it"
            )
        reason = spec.refusal(value, hf)
        if reason:
            raise UnsupportedConfigError(f"config field {key}={value!r} is not supported by the {architecture} "
                                         f"adapter: {reason}")
