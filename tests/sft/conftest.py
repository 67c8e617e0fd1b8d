"""What the SFT tests share: the SmolLM2 tokenizer, a Qwen2.5-style chat template, demonstration rows on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# A Qwen2.5-style template (written for these tests): a default system prompt when none is given, tool results
# grouped into one user turn as <tool_response> blocks, assistant tool calls as <tool_call> JSON.
QWEN_STYLE = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' or (m['role'] == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- elif m['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' + m['content'] }}"
    "{%- for c in m.get('tool_calls', []) %}{{- '\\n<tool_call>\\n' + (c | tojson) + '\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TOOL_CHAT = [
    {"role": "system", "content": "You can call a calculator."},
    {"role": "user", "content": "What is 17 * 23 + 4?"},
    {"role": "assistant", "content": "Let me compute 17 * 23 first.\n<tool_call>calc(17*23)</tool_call>"},
    {"role": "tool", "content": "391"},
    {"role": "assistant", "content": "<tool_call>calc(391+4)</tool_call>"},
    {"role": "tool", "content": "395"},
    {"role": "user", "content": "And in words?"},
    {"role": "assistant", "content": "17 * 23 + 4 = 395, three hundred ninety-five."},
]


@pytest.fixture(scope="session")
def smol_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def addition_rows(n: int, start: int = 1) -> list[dict]:
    """`a + b` conversations with a fixed answer format: a pattern a few SFT steps learn."""
    rows = []
    for k in range(start, start + n):
        a, b = 3 + (k * 7) % 40, 2 + (k * 11) % 30
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"What is {a} + {b}?"},
                    {"role": "assistant", "content": f"{a} + {b} = {a + b}. The answer is {a + b}."},
                ]
            }
        )
    return rows


def write_jsonl(path: Path, rows: list) -> Path:
    with path.open("w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path
