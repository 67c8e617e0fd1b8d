"""The built-in environments' prompts, splits and judging, and environment configs (yaml, errors, keys read)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from mcore_rl.envs import Episode, Trajectory, build_environment
from mcore_rl.envs.batch import episode_metrics, trajectory_tensors
from mcore_rl.envs.calc import evaluate
from mcore_rl.envs.calculator import example_call, final_number
from mcore_rl.envs.tool_calls import parse_tool_calls
from mcore_rl.registry import RegistryError

REPO = Path(__file__).resolve().parents[2]
YAMLS = sorted((REPO / "hydra_conf" / "env").glob("*.yaml"))


def episode(rec, attempts: int = 1) -> Episode:
    return Episode(rec, 0, list(rec.prompt), turn=attempts, attempts=attempts)


def test_calculator_problems_need_big_multiplications_and_splits_are_disjoint():
    env = build_environment({"name": "calculator", "size": 200, "heldout_size": 100})
    train, held = env.records("train"), env.records("heldout")
    assert len(train) == 200 and len(held) == 100
    assert not {r.metadata["question"] for r in train} & {r.metadata["question"] for r in held}
    assert [r.prompt for r in env.records("train")] == [r.prompt for r in train]  # deterministic
    for rec in train[:50]:
        nums = [int(x) for x in re.findall(r"\d+", rec.metadata["question"])]
        assert sum(n >= 1000 for n in nums) == 3 and int(rec.answer) > 0
        small = [n for n in nums if n < 1000]
        assert len(small) == 1 and 3 <= small[0] <= 99
    # the answer is what the calc tool computes from the problem's own numbers
    q = train[0].metadata["question"]
    nums = [int(x) for x in re.findall(r"\d+", q)]
    assert train[0].answer in {
        evaluate(f"{x}+{y}*{z}-{w}") for x in nums for y in nums for z in nums for w in nums
    }


def test_calculator_two_operation_problems_have_the_demonstrations_shape():
    env = build_environment({"name": "calculator", "operations": 2, "size": 100, "heldout_size": 50})
    train, held = env.records("train"), env.records("heldout")
    assert not {r.metadata["question"] for r in train} & {r.metadata["question"] for r in held}
    shapes = set()
    for rec in train:
        nums = [int(x) for x in re.findall(r"\d+", rec.metadata["question"])]
        assert len(nums) == 3 and 3 <= nums[0] <= 99 and min(nums[1:]) >= 1000 and int(rec.answer) > 0
        b, c, other = nums
        shape = {str(b * c - other): "b*c-d", str(b * c + other): "b*c+a"}[rec.answer]
        shapes.add(shape)
    assert shapes == {"b*c-d", "b*c+a"}
    # the three-operation default is unchanged by the option
    assert build_environment({"name": "calculator", "operations": 3}).records("train")[0].prompt == (
        build_environment({"name": "calculator"}).records("train")[0].prompt
    )


def test_calculator_judges_the_final_number():
    env = build_environment({"name": "calculator"})
    rec = env.records("train")[0]
    ans = int(rec.answer)
    for reply, reward in [
        (f"So the total is \\boxed{{{ans}}}.", 1.0),
        (f"The answer is {ans:,}.", 1.0),
        (f"\\boxed{{{ans + 1}}}", 0.0),
        ("I do not know.", 0.0),
    ]:
        fb = env.respond(episode(rec), reply)
        assert (fb.reward, fb.done, fb.correct) == (reward, True, reward == 1.0)
    assert env.respond(episode(rec), "I do not know.").reason == "no_answer"


@pytest.mark.parametrize("fmt", ["qwen", "smollm2", "llama"])
def test_calculator_prompt_shows_a_call_its_format_parses(fmt):
    env = build_environment({"name": "calculator", "tool_format": fmt})
    system = env.records("train")[0].prompt[0]["content"]
    assert example_call(fmt) in system
    (call,) = parse_tool_calls(example_call(fmt), fmt)
    assert call.valid and call.name == "calc" and evaluate(call.arguments["expression"]) == "110791"


@pytest.mark.parametrize("fmt", ["qwen", "llama"])
def test_calculator_demonstration_is_a_solved_call_in_the_configured_format(fmt):
    prompt = build_environment({"name": "calculator", "tool_format": fmt}).records("train")[0].prompt
    assert [m["role"] for m in prompt] == ["system", "user", "assistant", "tool", "assistant", "user"]
    (call,) = parse_tool_calls(prompt[2]["content"], fmt)
    assert evaluate(call.arguments["expression"]) == prompt[3]["content"] == "35774"
    assert prompt[4]["content"] == "\\boxed{35774}" and final_number(prompt[4]["content"]) == 35774
    plain = build_environment({"name": "calculator", "demonstration": False}).records("train")[0].prompt
    assert [m["role"] for m in plain] == ["system", "user"] and plain[1] == prompt[-1]


def test_final_number():
    assert final_number("x \\boxed{1,234}") == 1234 and final_number("answer: 7.0") == 7
    assert final_number("3.5") is None and final_number("none") is None


def test_retry_discounts_each_extra_attempt_and_never_reveals_the_answer():
    env = build_environment(
        {"name": "retry", "size": 8, "heldout_size": 4, "discount": 0.5, "max_attempts": 3}
    )
    rec = env.records("train")[0]
    gold = rec.answer
    right = f"<answer>{gold}</answer>"
    wrong = f"<answer>{int(float(gold)) + 1}</answer>"
    assert env.respond(episode(rec, 1), right).reward == 1.0
    fb = env.respond(episode(rec, 1), wrong)
    assert (fb.done, fb.reward) == (False, 0.0) and fb.messages[0]["role"] == "user"
    assert gold not in fb.messages[0]["content"] and str(int(float(gold)) + 1) in fb.messages[0]["content"]
    assert env.respond(episode(rec, 2), right).reward == 0.5
    assert env.respond(episode(rec, 3), right).reward == 0.25
    last = env.respond(episode(rec, 3), wrong)
    assert (last.done, last.reward, last.reason) == (True, 0.0, "out_of_attempts")
    assert "No answer given" in env.respond(episode(rec, 1), "hmm").messages[0]["content"]


def test_retry_heldout_questions_never_occur_in_training():
    env = build_environment(
        {
            "name": "retry",
            "size": 300,
            "heldout_size": 200,
            "task": "basic_arithmetic",
            "task_options": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        }
    )
    train = {env._dataset("train")[r.metadata["index"]]["question"] for r in env.records("train")}
    held = env.records("heldout")
    assert len(held) > 0 and not train & {
        env._dataset("heldout")[r.metadata["index"]]["question"] for r in held
    }


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.stem)
def test_shipped_yamls_build(path):
    cfg = OmegaConf.to_container(OmegaConf.load(path))
    env = build_environment(cfg)
    assert env.name == path.stem == cfg["name"]
    assert len(env.records("heldout")) == cfg["heldout_size"]


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"name": "calculator", "max_turn": 3}, "unknown key(s) ['max_turn']"),
        ({"name": "calculator", "max_turns": 0}, "env.max_turns=0 must be >= 1"),
        ({"name": "calculator", "tool_format": "xml"}, "env.tool_format='xml' must be one of"),
        ({"name": "calculator", "operations": 4}, "env.operations=4 must be one of [2, 3]"),
        ({"name": "retry", "discount": 0.0}, "env.discount=0.0 must be in (0, 1]"),
        ({"name": "retry", "task": "no_such_task"}, "env.task='no_such_task'"),
        (
            {"name": "calculator", "truncated_turn": "keep"},
            "env.truncated_turn='keep' must be one of end, close",
        ),
    ],
)
def test_bad_config_is_one_line_naming_the_key(cfg, message):
    with pytest.raises(ValueError) as e:
        build_environment(cfg).records("train")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_unknown_env_lists_the_choices():
    with pytest.raises(RegistryError, match=r"env='nope': expected one of .*calculator.*retry"):
        build_environment({"name": "nope"})


def _traj(mask, reward, tokens=None, **kw):
    n = len(mask)
    base = dict(
        prompt_id="p",
        sample_index=0,
        token_ids=tokens or list(range(10, 10 + n)),
        mask=mask,
        logprobs=[-0.5 * m for m in mask],
        versions=[3 if m else -1 for m in mask],
        prompt_len=2,
        turn_spans=[(2, 4), (6, 7)],
        turn_rewards=[0.0, reward],
        reward=reward,
        correct=reward > 0,
        tool_calls=1,
        valid_tool_calls=1,
        termination="answered",
        messages=[],
    )
    base.update(kw)
    return Trajectory(**base)


def test_trajectory_tensors_keep_the_holes_and_metrics_count_them():
    a = _traj([0, 0, 1, 1, 0, 0, 1], 1.0)
    b = _traj(
        [0, 0, 1, 0, 0], 0.0, turn_spans=[(2, 3)], tool_calls=2, valid_tool_calls=0, termination="max_turns"
    )
    t = trajectory_tensors([a, b], [0, 0], pad_id=99)
    assert t["tokens"].shape == (2, 7) and t["tokens"][1, 5:].tolist() == [99, 99]
    assert t["loss_mask"].tolist() == [[0, 0, 1, 1, 0, 0, 1], [0, 0, 1, 0, 0, 0, 0]]
    assert t["rollout_logp"][0].tolist() == [0, 0, -0.5, -0.5, 0, 0, -0.5]
    assert t["versions"][0].tolist() == [-1, -1, 3, 3, -1, -1, 3]
    assert t["response_len"].tolist() == [3.0, 1.0] and t["rewards"].tolist() == [1.0, 0.0]
    assert t["group_ids"].dtype == torch.long
    m = episode_metrics([a, b])
    assert (
        m["env/success"] == 0.5
        and m["env/turns"] == 1.5
        and m["env/valid_tool_call_rate"] == pytest.approx(1 / 3)
    )
    assert m["env/end_answered"] == 0.5 and m["env/end_max_turns"] == 0.5
    assert m["env/policy_token_frac"] == pytest.approx(4 / 8)


def test_trajectory_tensors_are_the_trainers_batch_fields():
    from mcore_rl.batch import RolloutBatch

    batch = RolloutBatch(**trajectory_tensors([_traj([0, 0, 1, 1, 0, 0, 1], 1.0)], [3]))
    assert {f.name for f in dataclasses.fields(RolloutBatch)} == set(
        trajectory_tensors([_traj([0, 1], 0.0)], [0])
    )
    assert batch.policy_batch().loss_mask.tolist() == [[0, 0, 1, 1, 0, 0, 1]]
