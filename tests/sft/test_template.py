"""The loss mask covers exactly the assistant turns as the chat template renders them, and bad rows are counted
by kind with their file and row number."""

from __future__ import annotations

import pytest

from mcore_rl.sft.data import load_examples
from mcore_rl.sft.template import BadRow, TemplateMasker, messages_of
from tests.sft.conftest import QWEN_STYLE, TOOL_CHAT, write_jsonl


def _segments(ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    """Runs of equal mask value: [(mask, ids)]."""
    out: list[tuple[int, list[int]]] = []
    for t, m in zip(ids, mask):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return out


@pytest.mark.parametrize("template", [None, QWEN_STYLE], ids=["smollm2_chatml", "qwen_style"])
def test_mask_is_exactly_the_assistant_turns(smol_tokenizer, template):
    masker = TemplateMasker(smol_tokenizer, template)
    ex = masker.example(TOOL_CHAT)
    replies = [m["content"] for m in TOOL_CHAT if m["role"] == "assistant"]
    scored = [smol_tokenizer.decode(seg) for m, seg in _segments(ex.ids, ex.mask) if m == 1]
    # each assistant turn: its content and the template's end-of-turn token, nothing of the header before it
    assert scored == [r + "<|im_end|>" for r in replies]
    # everything else (system, user, tool results, the assistant headers) is there, unscored
    full = masker.render(TOOL_CHAT, generation_prompt=False)
    assert smol_tokenizer.decode(ex.ids) == full[: full.rfind("<|im_end|>") + len("<|im_end|>")]
    unscored = "".join(smol_tokenizer.decode(seg) for m, seg in _segments(ex.ids, ex.mask) if m == 0)
    assert "391" in unscored and "395" in unscored and "And in words?" in unscored
    assert unscored.count("<|im_start|>assistant\n") == 3
    if template is QWEN_STYLE:  # the tool result is the template's user turn, never the model's
        assert "<tool_response>\n391\n</tool_response>" in unscored
        assert "You are Qwen" not in unscored  # a system message was given: no default one
    # the same ids as the template's own tokenisation of the conversation (no merge crosses a turn boundary here)
    kw = {"chat_template": template} if template else {}
    ref = smol_tokenizer.apply_chat_template(TOOL_CHAT, tokenize=False, **kw)
    assert ex.ids == smol_tokenizer(ref, add_special_tokens=False)["input_ids"][: len(ex.ids)]


def test_prompt_response_pairs_and_default_system(smol_tokenizer):
    masker = TemplateMasker(smol_tokenizer, QWEN_STYLE)
    ex = masker.example(messages_of({"prompt": "2+2?", "response": "4"}))
    segs = _segments(ex.ids, ex.mask)
    assert [m for m, _ in segs] == [0, 1]
    assert smol_tokenizer.decode(segs[0][1]).startswith("<|im_start|>system\nYou are Qwen")
    assert smol_tokenizer.decode(segs[1][1]) == "4<|im_end|>"


def test_bad_rows_are_counted_and_named(smol_tokenizer, tmp_path):
    # a template that renders earlier assistant turns differently from the last one (as reasoning templates
    # strip earlier thoughts): its prefixes are not prefixes of the whole conversation
    drifting = (
        "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
        "{%- if m['role'] == 'assistant' and not loop.last %}{{- m['content'][:1] }}"
        "{%- else %}{{- m['content'] }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    rows = [
        good,
        {"messages": [{"role": "user", "content": "only a question"}]},
        "{not json",
        {"prompt": "p", "response": "r " * 300},
        {"text": "no conversation"},
        good,
        {"messages": [{"role": "assistant", "content": "I start"}, {"role": "user", "content": "ok"}]},
        {"messages": [{"role": "robot", "content": "x"}]},
    ]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    examples, report = load_examples(
        str(path), "sft.data.path", TemplateMasker(smol_tokenizer), max_length=64
    )
    assert len(examples) == 2 and report.rows == 8 and report.kept == 2
    assert report.bad == {
        "no_assistant": [1, str(path), 1],
        "bad_json": [1, str(path), 2],
        "too_long": [1, str(path), 3],
        "malformed": [2, str(path), 4],
        "assistant_first": [1, str(path), 6],
    }
    assert "sft.data.path: skipped 1 row(s) of kind too_long (e.g. " + str(path) + " row 3)" in report.lines(
        "sft.data.path"
    )
    multi = {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "bcd"},
            {"role": "user", "content": "e"},
            {"role": "assistant", "content": "fgh"},
        ]
    }
    with pytest.raises(BadRow) as e:
        TemplateMasker(smol_tokenizer, drifting).example(multi["messages"])
    assert e.value.kind == "template_prefix"
    assert (
        TemplateMasker(smol_tokenizer).example(multi["messages"]).scored > 0
    )  # ChatML renders prefixes alike


def test_calculator_demonstrations_are_tokenised_as_the_rl_runner_builds_episodes(smol_tokenizer, tmp_path):
    """The rows `python -m mcore_rl.envs.demos` writes (a solved example inside the prompt, tool results, tool
    schemas): the SFT ids and mask are the ones RL's runner gives the same episode (TurnRenderer.episode_ids),
    so SFT trains on exactly the tokens RL later scores as the policy's."""
    import json

    from mcore_rl.envs.chat import TurnRenderer
    from mcore_rl.envs.demos import run

    out = tmp_path / "demos.jsonl"
    run(["env=calculator", "--split", "train", "--n", "4", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    examples, report = load_examples(
        str(out), "sft.data.path", TemplateMasker(smol_tokenizer), max_length=4096
    )
    assert len(rows) == len(examples) == 4 and not report.bad
    for row, ex in zip(rows, examples):
        in_prompt = [m for m in row["messages"][: row["prompt_messages"]] if m["role"] == "assistant"]
        assert in_prompt  # the prompt's solved example has assistant turns of its own: not trained on
        ids, mask = TurnRenderer(smol_tokenizer, row["tools"]).episode_ids(
            row["messages"], row["prompt_messages"]
        )
        assert (ex.ids, ex.mask) == (ids, mask)
        trained = [m for m in row["messages"][row["prompt_messages"] :] if m["role"] == "assistant"]
        scored = "".join(smol_tokenizer.decode([t]) for t, m in zip(ex.ids, ex.mask) if m)
        assert scored == "".join(m["content"] + "<|im_end|>" for m in trained)


def test_structured_tool_calls_with_special_tool_tokens_are_trained_whole(smollm2_dir):
    """Qwen's tokenizers make <tool_call> a special token: the turn still ends at the end-of-turn token, after
    the call the template renders from the message's `tool_calls` field."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    call = {"name": "calc", "arguments": {"expression": "17*23"}}
    chat = [{"role": "user", "content": "17*23?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "391"}, {"role": "assistant", "content": "391"}]  # fmt: skip
    masker = TemplateMasker(tok, QWEN_STYLE)
    assert masker.eot == "<|im_end|>"
    ex = masker.example(chat)
    scored = [tok.decode(seg) for m, seg in _segments(ex.ids, ex.mask) if m == 1]
    assert scored == ['\n<tool_call>\n{"name": "calc", "arguments": {"expression": "17*23"}}\n</tool_call><|im_end|>',
                      "391<|im_end|>"]  # fmt: skip
