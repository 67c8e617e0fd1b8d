"""A conversation -> token ids and a loss mask that covers exactly the assistant turns, found from the chat template.

Why render prefixes instead of searching for role markers: every template spells its turns differently (ChatML's
`<|im_start|>assistant\\n`, Llama 3's header ids, Qwen's default system prompt and `<tool_response>` wrapping),
but all of them answer two questions the same way: what the model sees when it is asked to reply (the prefix
rendered with the generation prompt) and where its reply ends (the prefix that includes the reply). The text
between the two, cut after the template's end-of-turn token, is what the policy writes; the rest is masked, as RL
masks the environment's tokens (envs/runner.py).

The ids are tokenised piece by piece (prompt text, reply text, prompt text, ...), the way RL produces them: the
engine tokenises the prompt it is given and the model writes the reply's ids after it, so no BPE merge ever
crosses the boundary between a prompt and a reply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


class BadRow(ValueError):
    """A row that cannot be trained on; `kind` names the counter it goes to (data.py reports one line per kind)."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(why)
        self.kind = kind


@dataclass(frozen=True)
class Example:
    """One tokenised conversation: ids and a 0/1 mask per id (1 = an assistant token, in the loss)."""

    ids: list[int]
    mask: list[int]

    @property
    def scored(self) -> int:
        return sum(self.mask)


@dataclass(frozen=True)
class Conversation:
    """A row's messages; the first `prompt_messages` are the prompt (an assistant turn there, e.g. a solved
    example, is shown, never trained on); `tools`: schemas the template renders into the prompt."""

    messages: list[dict[str, Any]]
    prompt_messages: int = 0
    tools: list[dict[str, Any]] | None = None


def conversation_of(row: Any) -> Conversation:
    """`{"messages": [...]}` (optionally `prompt_messages`, `tools`: the rows `python -m mcore_rl.envs.demos`
    writes), or `{"prompt": ..., "response": ...}`: a user turn (or the prompt's own messages) and one reply."""
    if not isinstance(row, Mapping):
        raise BadRow("malformed", f"a row must be an object, got {type(row).__name__}")
    if "messages" in row:
        msgs = row["messages"]
    elif "prompt" in row and "response" in row:
        prompt = row["prompt"]
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt or [])
        msgs = [*msgs, {"role": "assistant", "content": row["response"]}]
    else:
        raise BadRow("malformed", f"expected `messages` or `prompt` + `response`, got keys {sorted(row)[:8]}")
    if not isinstance(msgs, list) or not msgs:
        raise BadRow("malformed", "`messages` must be a non-empty list")
    for m in msgs:
        if not isinstance(m, Mapping) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise BadRow(
                "malformed", f"each message needs a role in {ROLES} and a string content, got {m!r:.80}"
            )
    head, tools = row.get("prompt_messages", 0), row.get("tools")
    if not isinstance(head, int) or isinstance(head, bool) or not 0 <= head < len(msgs):
        raise BadRow("malformed", f"prompt_messages={head!r} must be an int in [0, {len(msgs)})")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)):
        raise BadRow("malformed", "`tools` must be a list of tool schemas")
    return Conversation([dict(m) for m in msgs], head, [dict(t) for t in tools] if tools else None)


def messages_of(row: Any) -> list[dict[str, Any]]:
    return conversation_of(row).messages


class TemplateMasker:
    """Tokenises conversations with one tokenizer's chat template (or `chat_template`, overriding its own)."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; SFT on conversations needs one")
        self.tok, self.chat_template = tokenizer, chat_template
        self.eot = self._end_of_turn()

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        kw: dict[str, Any] = {"tokenize": False, "add_generation_prompt": generation_prompt}
        if tools:
            kw["tools"] = tools
        if self.chat_template is not None:
            kw["chat_template"] = self.chat_template
        return self.tok.apply_chat_template([dict(m) for m in messages], **kw)

    def _end_of_turn(self) -> str | None:
        """The special token the template writes right after an assistant message's content (ChatML's
        `<|im_end|>`, Llama 3's `<|eot_id|>`): the token the model stops on. Read from a reference reply, not
        searched for in each reply, because tool-call tags may be special tokens too (Qwen's `<tool_call>`).
        None: the template ends a reply with no special token."""
        reply = "R0"  # no template rewrites it (no whitespace at its ends, no reasoning tags)
        text = self.render([{"role": "user", "content": "Q"}, {"role": "assistant", "content": reply}], False)
        after = text[text.rfind(reply) + len(reply) :] if reply in text else ""
        specials = sorted({*self.tok.all_special_tokens, *self.tok.get_added_vocab()}, key=len, reverse=True)
        return next((t for t in specials if t and after.startswith(t)), None)

    def _reply_end(self, reply: str) -> int:
        """Where the policy's part of a rendered reply ends: after its end-of-turn token; what the template adds
        after that (ChatML's newline) is the next prompt's. Without such a token the reply ends where it ends."""
        at = reply.rfind(self.eot) if self.eot else -1
        return at + len(self.eot) if at >= 0 else len(reply)

    def spans(self, conv: Conversation) -> tuple[str, list[tuple[int, int]]]:
        """The full rendering and the [start, end) character span of each trained assistant turn in it."""
        messages, tools = conv.messages, conv.tools
        full = self.render(messages, False, tools)
        spans: list[tuple[int, int]] = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant" or i < conv.prompt_messages:
                continue
            if i == 0:
                raise BadRow(
                    "assistant_first",
                    "the conversation opens with an assistant turn: no prompt to learn from",
                )
            before = self.render(messages[:i], True, tools)
            upto = self.render(messages[: i + 1], False, tools)
            if not (full.startswith(before) and full.startswith(upto) and upto.startswith(before)):
                raise BadRow(
                    "template_prefix",
                    f"the template renders the conversation up to message {i} "
                    "differently from the whole conversation",
                )
            start = len(before)
            end = start + self._reply_end(upto[start:])
            if spans and start < spans[-1][1]:
                raise BadRow("template_prefix", f"assistant message {i} overlaps the previous one")
            spans.append((start, end))
        if not spans:
            raise BadRow("no_assistant", "no assistant turn")
        return full, spans

    def _ids(self, text: str) -> list[int]:
        return [int(t) for t in self.tok(text, add_special_tokens=False)["input_ids"]] if text else []

    def example(
        self, conv: Conversation | Sequence[Mapping[str, Any]], max_length: int | None = None
    ) -> Example:
        """Ids and mask of one conversation (or plain message list); BadRow for rows that cannot be trained on."""
        if not isinstance(conv, Conversation):
            conv = Conversation([dict(m) for m in conv])
        full, spans = self.spans(conv)
        ids: list[int] = []
        mask: list[int] = []
        pos = 0
        for start, end in spans:
            prompt, reply = self._ids(full[pos:start]), self._ids(full[start:end])
            ids += prompt + reply
            mask += [0] * len(prompt) + [1] * len(reply)
            pos = end
        # the tail after the last reply (a trailing newline) predicts nothing the loss scores: left out
        if max_length is not None and len(ids) > max_length:
            raise BadRow("too_long", f"{len(ids)} tokens > sft.max_length={max_length}")
        if not any(mask[1:]):  # position 0 is never predicted
            raise BadRow("no_assistant", "the assistant turns render no token")
        return Example(ids, mask)
