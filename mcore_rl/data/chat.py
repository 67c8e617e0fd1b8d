"""Prompt -> token ids with the tokenizer's own chat template (generation prompt appended)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mcore_rl.data.records import PromptRecord


def _prompt_of(record: PromptRecord | Mapping[str, Any] | str | list) -> Any:
    if isinstance(record, PromptRecord):
        return record.prompt
    if isinstance(record, Mapping):
        return record["prompt"]
    return record


def _ids(out: Any) -> list[int]:
    """transformers 5.x returns a BatchEncoding from apply_chat_template(tokenize=True); 4.x a list."""
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):  # a batch of one
        if len(out) != 1:
            raise ValueError(f"render_prompt: expected one sequence, got {len(out)}")
        out = out[0]
    return [int(t) for t in out]


def _messages(prompt: Any, system_prompt: str | None) -> list[dict[str, str]]:
    messages = [dict(m) for m in prompt]
    if system_prompt is not None:
        if messages and messages[0].get("role") == "system":
            messages[0]["content"] = system_prompt
        else:
            messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def render_prompt(tokenizer: Any, record: Any, system_prompt: str | None = None, **template_kwargs: Any) -> list[int]:
    """Token ids of a record's prompt. Chat prompts go through `apply_chat_template(add_generation_prompt=True)`;
    text prompts are encoded as-is. `system_prompt` overrides/prepends a system message; extra kwargs reach
    the template (e.g. enable_thinking=False for Qwen3)."""
    prompt = _prompt_of(record)
    if isinstance(prompt, str):
        return _ids(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"render_prompt: tokenizer {type(tokenizer).__name__} has no chat_template; "
            "set data.prompt_format=text for base models"
        )
    out = tokenizer.apply_chat_template(
        _messages(prompt, system_prompt), add_generation_prompt=True, tokenize=True, **template_kwargs
    )
    return _ids(out)


def render_prompt_text(tokenizer: Any, record: Any, system_prompt: str | None = None, **template_kwargs: Any) -> str:
    """The same prompt as a string (for engines that take text)."""
    prompt = _prompt_of(record)
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(
        _messages(prompt, system_prompt), add_generation_prompt=True, tokenize=False, **template_kwargs
    )
