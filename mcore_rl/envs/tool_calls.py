"""Tool-call formats: how a model's reply spells its calls, per chat-template family.

Formats follow what SGLang's function-call detectors accept (sglang/srt/function_call/), so a policy trained here
calls tools the way a served model is parsed:
- `qwen` (Qwen2.5 / Qwen3): one `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` block per call.
- `smollm2` (SmolLM2 / Hermes style): `<tool_call>` blocks whose JSON is one call or a list of calls.
- `llama` (Llama 3.x JSON tool calling): the reply is, after an optional `<|python_tag|>`, JSON call objects
  separated by `;`, arguments under "arguments" or "parameters".

A malformed call is never an exception: it becomes a `ToolCall` with `error` set, which the runner answers with a
tool error message (and counts as an invalid call).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mcore_rl.registry import Registry


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why the call is malformed (None = well formed)

    @property
    def valid(self) -> bool:
        return self.error is None


Parser = Callable[[str], list[ToolCall]]
TOOL_FORMATS: Registry[Parser] = Registry("env.tool_format")
_TAGGED = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _call_from(obj: Any, arg_keys: tuple[str, ...] = ("arguments",)) -> ToolCall:
    if not isinstance(obj, dict):
        return ToolCall("", error=f"a tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", error='a tool call needs a string "name"')
    args: Any = {}
    for key in arg_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models emit the arguments object JSON-encoded
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCall(name, error="arguments are not valid JSON")
    if not isinstance(args, dict):
        return ToolCall(name, error="arguments must be a JSON object")
    return ToolCall(name, args)


def _loads(text: str) -> tuple[Any, str | None]:
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, f"invalid JSON in tool call ({e.msg} at char {e.pos})"


@TOOL_FORMATS.register("qwen")
def parse_qwen(reply: str) -> list[ToolCall]:
    calls = []
    for body in _TAGGED.findall(reply):
        obj, err = _loads(body.strip())
        calls.append(ToolCall("", error=err) if err else _call_from(obj))
    return calls


@TOOL_FORMATS.register("smollm2")
def parse_smollm2(reply: str) -> list[ToolCall]:
    calls = []
    for body in _TAGGED.findall(reply):
        obj, err = _loads(body.strip())
        if err:
            calls.append(ToolCall("", error=err))
        else:
            calls.extend(_call_from(o) for o in (obj if isinstance(obj, list) else [obj]))
    return calls


@TOOL_FORMATS.register("llama")
def parse_llama(reply: str) -> list[ToolCall]:
    text = reply.split("<|python_tag|>", 1)[1] if "<|python_tag|>" in reply else reply.strip()
    if not text.lstrip().startswith("{"):
        return []
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(text):
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
        if pos >= len(text):
            break
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", error=f"invalid JSON in tool call ({e.msg} at char {e.pos})"))
            break
        calls.append(_call_from(obj, ("arguments", "parameters")))
        pos = end
    return calls


def parse_tool_calls(reply: str, tool_format: str) -> list[ToolCall]:
    """Every call in `reply` (well formed or not), in order."""
    return TOOL_FORMATS.get(tool_format)(reply)


def check_arguments(call: ToolCall, schema: dict[str, Any]) -> ToolCall:
    """Mark a call whose arguments miss a required key or carry an unknown one (JSON-schema `properties`)."""
    if not call.valid:
        return call
    props = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in call.arguments]
    extra = [k for k in call.arguments if props and k not in props]
    if missing:
        return ToolCall(call.name, call.arguments, f"missing argument(s) {missing}")
    if extra:
        return ToolCall(call.name, call.arguments, f"unknown argument(s) {extra}")
    return call
