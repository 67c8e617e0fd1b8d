"""The renderer against templates that treat the last assistant turn specially, and templates it must refuse."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from mcore_rl.envs.chat import TurnRenderer
from tests.envs.conftest import HERE

QWEN = (HERE / "qwen_template.jinja").read_text()
PLAIN_TURN = "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
# Qwen3 renders an empty <think> block into the last assistant turn only
QWEN3_LIKE = QWEN.replace(
    PLAIN_TURN,
    "{%- if message.role == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- else %}" + PLAIN_TURN + "{%- endif %}",
)
TOOLS = [
    {"type": "function", "function": {"name": "calc", "description": "", "parameters": {"type": "object"}}}
]


@pytest.fixture(scope="module")
def tok(qwen_dir):
    return AutoTokenizer.from_pretrained(qwen_dir)


def test_qwen3_style_last_turn_rendering_does_not_move_the_boundary(tok):
    assert QWEN3_LIKE != QWEN
    r = TurnRenderer(tok, TOOLS, chat_template=QWEN3_LIKE)
    cont = r.continuation_ids([{"role": "tool", "name": "calc", "content": "42"}])
    text = tok.decode(cont, skip_special_tokens=False)
    assert (
        text == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert r.eot_text == "<|im_end|>" and cont[-1] != r.eot_id


def test_prompt_renders_tools_and_the_assistant_header(tok):
    r = TurnRenderer(tok, TOOLS)
    text = tok.decode(r.prompt_ids([{"role": "user", "content": "hi"}]), skip_special_tokens=False)
    assert '"name": "calc"' in text and text.endswith(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    "template, error",
    [
        ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", "not a special token"),
        (
            "{% for m in messages %}{% if m.role != 'assistant' %}<|im_start|>{{ m.content }}<|im_end|>"
            "{% endif %}{% endfor %}",
            "does not render assistant content verbatim",
        ),
    ],
)
def test_templates_without_a_usable_turn_boundary_are_refused(tok, template, error):
    with pytest.raises(ValueError, match=error):
        TurnRenderer(tok, chat_template=template)
