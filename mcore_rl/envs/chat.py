"""Token-in, token-out turns: the chat template renders only the new messages, never the model's earlier output.

Why: re-rendering the whole conversation and re-tokenizing it can change the ids of earlier model output (BPE
merges across a boundary, templates that strip whitespace or reasoning), so the trained ids would differ from the
ids the engine sampled and their log-probs would belong to other tokens. Here the trajectory is append-only: the
engine's output ids are kept as they are, and what comes between two model turns (tool results, feedback, the next
assistant header) is cut from the template's rendering of a fixed reference conversation followed by the new
messages: everything after the reference reply's end-of-turn token. That text is tokenized alone and appended, so
it sits at exactly the boundary the template would put it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mcore_rl.envs.base import Message

_REF_USER = "Q"
_REF_REPLY = "R0"  # a reply no template rewrites (no whitespace at its ends, no reasoning tags)


class TurnRenderer:
    """Render an episode's first prompt and, after each model turn, the ids to append before the next one."""

    def __init__(
        self, tokenizer: Any, tools: Sequence[dict[str, Any]] | None = None, chat_template: str | None = None
    ) -> None:
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; multi-turn environments need one")
        self.tok = tokenizer
        self.tools = list(tools) if tools else None
        self.chat_template = chat_template
        self._ref = [{"role": "user", "content": _REF_USER}, {"role": "assistant", "content": _REF_REPLY}]
        text = self._render(self._ref, generation_prompt=False)
        at = text.rfind(_REF_REPLY)
        if at < 0:
            raise ValueError("the chat template does not render assistant content verbatim")
        eot = self._end_of_turn(text[at + len(_REF_REPLY) :])
        self.eot_text = eot
        self.eot_id = int(tokenizer.convert_tokens_to_ids(eot))
        self._reply_end = _REF_REPLY + eot

    def _render(self, messages: Sequence[Message], generation_prompt: bool) -> str:
        kw: dict[str, Any] = {"tokenize": False, "add_generation_prompt": generation_prompt}
        if self.tools:
            kw["tools"] = self.tools
        if self.chat_template is not None:
            kw["chat_template"] = self.chat_template
        return self.tok.apply_chat_template(list(messages), **kw)

    def _end_of_turn(self, after_reply: str) -> str:
        """The special token the template puts right after an assistant message (the one the model stops on)."""
        specials = sorted(
            set(self.tok.all_special_tokens) | set(self.tok.get_added_vocab()), key=len, reverse=True
        )
        for s in specials:
            if s and after_reply.startswith(s):
                return s
        raise ValueError(
            f"the chat template ends an assistant turn with {after_reply[:20]!r}, not a special token"
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The first prompt: the conversation so far plus the assistant header."""
        return self.encode(self._render(messages, generation_prompt=True))

    def continuation_ids(self, new_messages: Sequence[Message]) -> list[int]:
        """What follows a finished assistant turn (ending in its end-of-turn token): `new_messages` and the next
        assistant header, exactly as the template renders them at that point.

        The cut is made in the rendering *with* the new messages, right after the reference reply's end-of-turn
        token: templates that render the last assistant turn differently from earlier ones (Qwen3 adds an empty
        <think> block to the last one only) change text before the cut, which is never used."""
        full = self._render([*self._ref, *new_messages], generation_prompt=True)
        at = full.find(self._reply_end)
        if at < 0:
            raise ValueError("the chat template drops or rewrites an assistant reply once messages follow it")
        return self.encode(full[at + len(self._reply_end) :])

    def episode_ids(self, messages: Sequence[Message], prompt_messages: int) -> tuple[list[int], list[int]]:
        """(ids, mask) of a finished episode as the runner builds it, for supervised training on demonstrations:
        the first `prompt_messages` messages as the prompt, each later assistant message as its content's ids plus
        the end-of-turn token (mask 1: what the policy emits), and each run of other messages as the continuation
        cut after the previous turn (mask 0). Unlike tokenizing the whole rendered conversation, nothing comes after
        the last end-of-turn token (ChatML templates add a newline there that the policy never produces), and
        templates that rewrite earlier assistant turns (Qwen3's <think> blocks) cannot shift a boundary."""
        if len(messages) > prompt_messages and messages[prompt_messages].get("role") != "assistant":
            raise ValueError("the first message after the prompt must be the model's (role assistant)")
        ids = self.prompt_ids(messages[:prompt_messages])
        mask = [0] * len(ids)
        pending: list[Message] = []
        for m in messages[prompt_messages:]:
            if m.get("role") != "assistant":
                pending.append(m)
                continue
            if pending:
                cont = self.continuation_ids(pending)
                ids, mask, pending = ids + cont, mask + [0] * len(cont), []
            turn = [*self.encode(str(m.get("content") or "")), self.eot_id]
            ids, mask = ids + turn, mask + [1] * len(turn)
        if pending:
            raise ValueError("an episode ends with a model turn, not with a tool or environment message")
        return ids, mask

    def render_text(self, messages: Sequence[Message]) -> str:
        """The whole conversation as the template renders it (for checks and logs; never used for ids)."""
        return self._render(messages, generation_prompt=False)
