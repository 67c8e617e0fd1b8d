"""Scripted-solver demonstrations (`python -m mcore_rl.envs.demos`): every written episode replays to success through
the real environment and tool sandbox, and its tokens are, id for id, the episode the RL runner would build."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from mcore_rl.envs import build_environment
from mcore_rl.envs.calc import evaluate
from mcore_rl.envs.calculator import final_number
from mcore_rl.envs.chat import TurnRenderer
from mcore_rl.envs.demos import Replay, env_config, main, solved_rows
from mcore_rl.envs.runner import EpisodeRunner
from mcore_rl.envs.tool_calls import TOOL_FORMATS, parse_tool_calls
from mcore_rl.rollout.protocol import Sample, SamplingParams

REPO = Path(__file__).resolve().parents[2]
FORMATS = ("qwen", "smollm2", "llama")  # the built-in ones (other test modules register more)


def calculator(**kw):
    return build_environment({"name": "calculator", "size": 24, "heldout_size": 8, **kw})


def question(row) -> str:
    return [m for m in row["messages"] if m["role"] == "user"][-1]["content"]


@pytest.mark.parametrize("operations", [2, 3])
@pytest.mark.parametrize("tool_format", FORMATS)
def test_every_calculator_demo_replays_to_success(operations, tool_format):
    assert set(FORMATS) <= set(TOOL_FORMATS.names())
    env = calculator(operations=operations, tool_format=tool_format)
    for split in ("train", "heldout"):
        records = env.records(split)
        rows, dropped = solved_rows(env, records)
        assert dropped == [] and len(rows) == len(records)
        for rec, row in zip(records, rows):
            start = env.start(rec)
            msgs = row["messages"]
            assert msgs[: len(start)] == start and (row["prompt_id"], row["answer"]) == (
                rec.prompt_id,
                rec.answer,
            )
            call, result, answer = msgs[len(start) :]
            # the call is spelled in the env's format, and its expression is the problem's own arithmetic
            (parsed,) = parse_tool_calls(call["content"], tool_format)
            assert parsed.valid and parsed.name == "calc"
            expr = parsed.arguments["expression"]
            assert expr.count("*") == 1 and expr.count(" + ") + expr.count(" - ") == operations - 1
            assert (
                result == {"role": "tool", "name": "calc", "content": evaluate(expr)}
                and result["content"] == rec.answer
            )
            assert final_number(answer["content"]) == int(rec.answer)
            # and a wrong number in that reply would score 0 (the judge is not trivially satisfied)
            assert final_number(answer["content"].replace(rec.answer, str(int(rec.answer) + 1))) != int(
                rec.answer
            )


def _corrupt(turns, how: str):
    call, result, answer = (dict(m) for m in turns)
    if how == "wrong_answer":
        answer["content"] = answer["content"].replace(result["content"], str(int(result["content"]) + 1))
    elif how == "other_format":  # llama's bare JSON where the env expects <tool_call> blocks: no call
        call["content"] = call["content"].removeprefix("<tool_call>").removesuffix("</tool_call>")
    elif how == "bad_tool_result":
        result["content"] = "12345"
    elif how == "bad_expression":
        call["content"] = call["content"].replace('"expression"', '"expr"')
    return [call, result, answer]


@pytest.mark.parametrize(
    "how, why",
    [
        ("wrong_answer", "judged answered"),
        ("other_format", "ended the episode at turn 1"),
        ("bad_tool_result", "the messages after turn 1 are not"),
        ("bad_expression", "invalid tool call in turn 1"),
    ],
)
def test_replay_drops_a_demo_the_env_would_not_reward(how, why):
    env = calculator(tool_format="qwen", size=2)
    rec = env.records("train")[0]
    replay = Replay(env)
    try:
        assert replay.check(rec, env.solve(rec)) is None
        assert why in replay.check(rec, _corrupt(env.solve(rec), how))
    finally:
        replay.close()
    short = calculator(tool_format="qwen", size=2, max_turns=1)
    assert "last allowed turn" in Replay(short).check(rec, env.solve(rec))


def test_retry_demos_answer_at_the_first_attempt():
    env = build_environment({"name": "retry", "size": 8, "heldout_size": 4})
    rows, dropped = solved_rows(env, env.records("train"))
    assert dropped == [] and len(rows) == 8 and all(r["tools"] == [] for r in rows)
    assert all(r["messages"][-1]["content"] == f"<answer>{r['answer']}</answer>" for r in rows)


class ScriptedEngine:
    """A RolloutEngine whose every turn 'samples' the demo's next assistant turn: its content's ids + end of turn."""

    def __init__(self, turns: dict[str, list[list[int]]]) -> None:
        self.turns = turns

    def submit(self, requests):
        futures = []
        for r in requests:
            episode, turn = r.rid.split("#")[0], int(r.rid.rsplit("/t", 1)[1])
            out = self.turns[episode][turn - 1]
            assert len(out) <= r.sampling.max_new_tokens  # the turn fits the env's per-turn budget
            f: Future = Future()
            f.set_result(Sample(r.rid, list(r.prompt_ids), out, [-0.5] * len(out), [0] * len(out), "stop"))
            futures.append(f)
        return futures

    def abort(self, rid=None) -> None:
        pass


@pytest.mark.parametrize("template", ["smol", "qwen"])
def test_demo_tokens_are_the_rl_runners_episode(template, request, smollm2_dir):
    """SmolLM2's own template (ChatML, tool results as `tool` turns) and a Qwen2.5-style one (tool results as one
    user turn of <tool_response> blocks): the runner, fed the demo's replies as policy tokens, builds exactly the ids
    of the whole rendered demo but its last token (the newline after the final end of turn), and the mask is 1
    exactly on the replies' tokens and their end-of-turn tokens."""
    folder = smollm2_dir if template == "smol" else request.getfixturevalue("qwen_dir")
    tok = AutoTokenizer.from_pretrained(folder)
    fmt = "smollm2" if template == "smol" else "qwen"
    for operations in (2, 3):
        env = calculator(operations=operations, tool_format=fmt, size=3)
        records = env.records("train")
        rows, _ = solved_rows(env, records)
        renderer = TurnRenderer(tok, rows[0]["tools"])
        script = {
            row["prompt_id"]: [
                [*renderer.encode(m["content"]), renderer.eot_id]
                for m in row["messages"][row["prompt_messages"] :]
                if m["role"] == "assistant"
            ]
            for row in rows
        }
        runner = EpisodeRunner(env, ScriptedEngine(script), renderer)
        try:
            trajs = runner.run(records, SamplingParams(temperature=1.0))
        finally:
            runner.tools.close()
        for row, traj, rec in zip(rows, trajs, records):
            assert (traj.reward, traj.correct, traj.termination) == (1.0, True, "answered")
            assert traj.tool_calls == traj.valid_tool_calls == 1 and traj.messages == row["messages"]
            full = tok.apply_chat_template(
                row["messages"], tools=row["tools"], tokenize=True, return_dict=True
            )
            full = list(full["input_ids"])
            assert traj.token_ids == full[:-1] and tok.decode(full[-1:]) == "\n"
            assert row["prompt_messages"] == len(env.start(rec)) == len(rec.prompt)
            assert renderer.episode_ids(row["messages"], row["prompt_messages"]) == (
                traj.token_ids,
                traj.mask,
            )
            policy = [tok.decode(traj.token_ids[s:e], skip_special_tokens=False) for s, e in traj.turn_spans]
            episode = row["messages"][row["prompt_messages"] :]
            replies = [m["content"] + renderer.eot_text for m in episode if m["role"] == "assistant"]
            assert policy == replies and sum(traj.mask) == sum(e - s for s, e in traj.turn_spans)


def test_heldout_demos_never_share_a_question_with_training():
    for operations in (2, 3):
        env = build_environment({"name": "calculator", "operations": operations})  # 256 train, 64 held out
        train = {r.metadata["question"] for r in env.records("train")}
        held_rows, dropped = solved_rows(env, env.records("heldout"))
        assert len(held_rows) == 64 and dropped == [] and len(train) == 256
        assert not {question(r) for r in held_rows} & train


def test_cli_writes_n_rows_with_the_env_keys_given(tmp_path):
    out = tmp_path / "demos.jsonl"
    args = [
        "env=calculator",
        "env.operations=2",
        "env.tool_format=llama",
        "env.size=12",
        "env.heldout_size=4",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "mcore_rl.envs.demos", *args, "--split", "train", "--n", "10", "--out", str(out)],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "wrote 10 demonstrations" in proc.stdout and "dropped 0" in proc.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    env = build_environment({"name": "calculator", "operations": 2, "tool_format": "llama", "size": 12})
    records = env.records("train")[:10]
    assert [r["prompt_id"] for r in rows] == [r.prompt_id for r in records]
    assert [r["messages"][: len(env.start(rec))] for r, rec in zip(rows, records)] == [
        env.start(r) for r in records
    ]
    assert all(json.loads(r["messages"][-3]["content"])["name"] == "calc" for r in rows)  # llama: bare JSON


@pytest.mark.parametrize(
    "args, error",
    [
        (["env=calculator", "env.num_ops=3"], "unknown key(s) ['num_ops']"),
        (["env=calculator", "env.operations=5"], "env.operations=5 must be one of [2, 3]"),
        (["env=calculator", "--n", "300"], "--n 300 > the 256 train records: raise env.size"),
        (["env=calculator", "--split", "test"], "split='test'"),
        (["calculator"], "expected env=NAME or env.KEY=VALUE"),
        (["env=calculator", "env.size=abc"], "env.size='abc' must be of type int"),
        (["env=calculator", "env.size=["], "override 'env.size=[': not a YAML value"),
        (["env=calculator", "env.size.x=1"], "env.size is not a mapping"),
        (["env.size=3"], "no environment: give env=NAME"),
    ],
)
def test_cli_fails_with_one_line(args, error, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([*args, "--out", str(tmp_path / "x.jsonl")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and error in err, err
    assert not (tmp_path / "x.jsonl").exists()


def test_overrides_are_typed_as_hydra_types_them_and_reach_nested_keys(tmp_path):
    cfg = env_config(["env=retry", "env.discount=5e-1", "+env.seed=3", "env.task_options.max_terms=2"])
    assert (
        cfg["discount"] == 0.5 and cfg["seed"] == 3 and cfg["max_turns"] == 3
    )  # the rest from env/retry.yaml
    assert cfg["task_options"] == {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 2,
        "operators": ["+", "-"],
    }
    out = tmp_path / "retry.jsonl"
    main(["env=retry", "env.size=6", "env.task_options.max_terms=2", "--n", "5", "--out", str(out)])
    questions = [json.loads(line)["messages"][0]["content"] for line in out.read_text().splitlines()]
    assert len(questions) == 5 and all(q.count(" + ") + q.count(" - ") == 1 for q in questions), questions


PLUGIN = """
from mcore_rl.data.records import PromptRecord
from mcore_rl.envs import ENVS, Environment, Feedback


@ENVS.register("demo_echo")
class EchoEnv(Environment):
    def records(self, split):
        return [PromptRecord(f"echo-{split}-{i}", f"Say {i}.", str(i)) for i in range(3)]

    def respond(self, episode, reply):
        ok = reply == episode.record.answer
        return Feedback(float(ok), True, correct=ok, reason="answered")

    def solve(self, record):
        return [{"role": "assistant", "content": record.answer}]


@ENVS.register("demo_unsolved")
class UnsolvedEnv(EchoEnv):
    solve = Environment.solve
"""


@pytest.fixture
def plugin_state():
    """The plugin list and the environment registry restored after the test (a later test in this process, e.g.
    tests/plugins, must not see `demo_plugin_env` as loaded nor its environments as registered)."""
    import sys

    from mcore_rl import plugins
    from mcore_rl.envs.base import ENVS

    state = list(plugins._loaded), list(plugins._registered)
    entries, origin = dict(ENVS._entries), dict(ENVS._origin)
    yield
    plugins._loaded[:], plugins._registered[:] = state
    ENVS._entries, ENVS._origin = entries, origin
    sys.modules.pop("demo_plugin_env", None)


def test_a_users_environment_with_a_solver_via_plugin(tmp_path, monkeypatch, capsys, plugin_state):
    (tmp_path / "demo_plugin_env.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("MCORE_RL_PLUGINS", "")
    out = tmp_path / "echo.jsonl"
    main(["--plugin", "demo_plugin_env", "env=demo_echo", "--split", "heldout", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["messages"] for r in rows] == [
        [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": str(i)}] for i in range(3)
    ]
    with pytest.raises(SystemExit):
        main(["--plugin", "demo_plugin_env", "env=demo_unsolved", "--out", str(out)])
    assert "env='demo_unsolved' has no scripted solver" in capsys.readouterr().err
