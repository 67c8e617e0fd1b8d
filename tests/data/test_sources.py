"""Generators (a+b, reasoning-gym), CHAMP, the Hydra data yamls, and SmolLM2 chat templating."""

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mcore_rl.data import build_dataset, render_prompt, render_prompt_text

pytestmark = pytest.mark.rollout

CONF = Path(__file__).resolve().parents[2] / "hydra_conf" / "data"
CHATML = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
          "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")


def test_arithmetic_generator_shape_and_answers():
    ds = build_dataset({"kind": "arithmetic", "size": 200, "seed": 11})
    pattern = re.compile(r"^What is (\d+) \+ (\d+)\? Answer with just the number\.$")
    for rec in ds:
        (msg,) = rec.prompt
        m = pattern.match(msg["content"])
        assert msg["role"] == "user" and m, msg
        a, b = int(m.group(1)), int(m.group(2))
        assert 0 <= a <= 20 and 0 <= b <= 20 and rec.answer == str(a + b)
    again = build_dataset({"kind": "arithmetic", "size": 200, "seed": 11})
    other = build_dataset({"kind": "arithmetic", "size": 200, "seed": 12})
    assert [r.prompt for r in again] == [r.prompt for r in ds] != [r.prompt for r in other]
    mixed = build_dataset({"kind": "arithmetic", "size": 300, "ops": ["-", "*"], "max_operand": 5})
    for rec in mixed:
        assert rec.answer == str(rec.metadata["a"] - rec.metadata["b"] if rec.metadata["op"] == "-"
                                 else rec.metadata["a"] * rec.metadata["b"])
    assert {r.metadata["op"] for r in mixed} == {"-", "*"}


def test_reasoning_gym_yaml():
    ds = build_dataset(OmegaConf.load(CONF / "reasoning_gym.yaml"))
    assert len(ds) == 1024 and ds.summary.num_skipped == 0
    for rec in list(ds)[:50]:
        numbers = [int(t) for t in re.findall(r"\d+", rec.metadata["expression"])]
        assert rec.prompt[0]["content"].endswith("Answer with just the number.")
        assert len(numbers) == 2 and max(numbers) <= 99 and abs(int(rec.answer)) <= 2 * 99
    assert build_dataset({"kind": "reasoning_gym", "size": 5, "seed": 3})[0].answer == \
        build_dataset({"kind": "reasoning_gym", "size": 5, "seed": 3})[0].answer
    with pytest.raises(ValueError, match="data.name='no_such_task'"):
        build_dataset({"kind": "reasoning_gym", "name": "no_such_task", "size": 2})


def test_champ_has_270_problems():
    ds = build_dataset(OmegaConf.load(CONF / "champ.yaml"))
    assert len(ds) == 270 and ds.summary.num_skipped == 0
    assert len({r.prompt_id for r in ds}) == 270
    assert all(r.answer and r.prompt[-1]["content"].endswith("\\boxed{}.") for r in ds)
    assert "@@" not in "".join(r.answer + r.prompt[-1]["content"] for r in ds)
    assert ds.by_id("P_Combinatorics_1").answer == "239"
    cats = {r.metadata["category"] for r in ds}
    assert cats == {"Combinatorics", "Inequality", "Number-Theory", "Polynomial", "Sequence"}
    nt = build_dataset({"kind": "champ", "categories": ["Number-Theory"]})
    assert len(nt) == 80


def test_every_data_yaml_builds(tmp_path):
    rows = tmp_path / "train.jsonl"
    rows.write_text('{"question": "What is 1 + 1?", "answer": "2"}\n')
    for yaml in sorted(CONF.glob("*.yaml")):
        cfg = OmegaConf.load(yaml)
        if cfg.kind == "hf":
            cfg.path = str(rows)
        ds = build_dataset(cfg)
        assert len(ds) >= 1 and ds[0].answer, yaml.name


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from mcore_rl.models.smollm2 import materialize_smollm2

    return AutoTokenizer.from_pretrained(materialize_smollm2())


def test_chat_template_gives_smollm2_chatml_ids(tokenizer):
    rec = build_dataset({"kind": "arithmetic", "size": 1, "seed": 0})[0]
    q = rec.prompt[0]["content"]
    ids = render_prompt(tokenizer, rec)
    assert ids == tokenizer.encode(CHATML.format(q=q), add_special_tokens=False)
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert (im_start, im_end) == (1, 2)  # SmolLM2's ChatML special tokens
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2
    assert ids[-3:] == tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)[-3:]
    assert tokenizer.decode(ids) == CHATML.format(q=q)
    assert render_prompt_text(tokenizer, rec) == CHATML.format(q=q)
    # A system prompt replaces the template's default one; dict records work too.
    ids_sys = render_prompt(tokenizer, rec.to_dict(), system_prompt="Be brief.")
    assert tokenizer.decode(ids_sys).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    # Text prompts skip the template.
    assert render_prompt(tokenizer, {"prompt": "3 + 4 ="}) == tokenizer("3 + 4 =")["input_ids"]


def test_missing_chat_template_is_a_clear_error(tokenizer):
    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="has no chat_template; set data.prompt_format=text"):
        render_prompt(NoTemplate(), {"prompt": [{"role": "user", "content": "hi"}]})
