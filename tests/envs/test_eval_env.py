"""`mcore-rl-eval --env NAME` through the CLI on a tiny random model behind the real SmolLM2 chat template.

Random weights never solve anything, so the environments here make the numbers predictable from the episode
itself: `test_eval_parity` answers every first reply with feedback and judges the second by (record, sample)
parity, so success, pass@k and turns are known before the run; the calculator through a tool format that makes
every reply a `calc` call (well formed iff the reply has an even number of characters) gives 3 turns, 3 calls per
episode and a valid-call rate that must equal the count over the episodes written to --samples-out.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mcore_rl.data.records import PromptRecord
from mcore_rl.envs import ENVS, EnvConfig, Environment, Feedback
from mcore_rl.envs.tool_calls import TOOL_FORMATS, ToolCall
from mcore_rl.evaluation.passk import pass_at_k
from tests.evaluation.conftest import _inproc, read_jsonl

N_RECORDS, N = 3, 4


def _solved(record_index: int, sample_index: int) -> bool:
    return (record_index + sample_index) % 3 == 0


@ENVS.register("test_eval_parity")
class ParityEnv(Environment):
    """Two turns per episode: the first reply gets 'try again', the second is correct iff `_solved`."""

    config_cls = EnvConfig

    def records(self, split: str) -> list[PromptRecord]:
        n = self.config.heldout_size if split == "heldout" else self.config.size
        return [PromptRecord(f"par-{i}", [{"role": "user", "content": f"Say {i}."}], str(i)) for i in range(n)]

    def respond(self, episode, reply: str) -> Feedback:
        if episode.attempts == 1:
            return Feedback(0.0, done=False, messages=[{"role": "user", "content": "Try again."}])
        ok = _solved(int(episode.record.answer), episode.sample_index)
        return Feedback(1.0 if ok else 0.0, done=True, correct=ok, reason="answered")


@TOOL_FORMATS.register("test_eval_even_calls")
def _even_calls(reply: str) -> list[ToolCall]:
    if len(reply) % 2:
        return [ToolCall("calc", {}, error="odd reply")]
    return [ToolCall("calc", {"expression": "2+3"})]


@pytest.fixture
def eval_inproc(capsys):
    from mcore_rl.evaluation.cli import main

    return _inproc(capsys, main)


def _run(eval_inproc, model: Path, tmp_path: Path, *args: str):
    out, samples = tmp_path / "res.jsonl", tmp_path / "samples.jsonl"
    proc = eval_inproc(str(model), "-n", str(N), "--num-prompts", str(N_RECORDS), "--temperature", "1.0",
                       "--seed", "11", "--no-progress", "--out", str(out), "--samples-out", str(samples), *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, read_jsonl(out), read_jsonl(samples)


def test_eval_env_success_and_passk_are_the_predicted_ones(smol_dir, tmp_path, eval_inproc):
    spec = "test_eval_parity:heldout_size=5,max_turns=2,max_new_tokens=4,truncated_turn=close"
    proc, (line,), rows = _run(eval_inproc, smol_dir, tmp_path, "--env", spec)
    expected = np.array([[_solved(i, j) for j in range(N)] for i in range(N_RECORDS)])
    assert line["env"] == spec and line["source"] == "env_test_eval_parity" and "set" not in line
    assert line["num_prompts"] == N_RECORDS and line["n"] == N and line["max_new_tokens"] == 4
    assert line["mean_at_n"] == line["success"] == pytest.approx(expected.mean())  # 4/12
    for k in range(1, N + 1):
        want = np.mean([pass_at_k(N, int(c), k) for c in expected.sum(1)])
        assert line[f"pass_at_{k}"] == pytest.approx(want)
    assert line["turns"] == 2.0 and line["tool_calls"] == 0.0 and line["end_answered"] == 1.0
    assert line["reward"] == pytest.approx(expected.mean()) and line["truncation_rate"] == 0.0
    assert [r["correct"] for r in rows] == expected.tolist()
    episodes = [e for r in rows for e in r["episodes"]]
    assert line["response_len"] == pytest.approx(np.mean([e["policy_tokens"] for e in episodes]))
    assert all([m["role"] for m in e["messages"]] == ["user", "assistant", "user", "assistant"] for e in episodes)
    assert all(1 <= e["policy_tokens"] <= 8 for e in episodes)  # two turns of at most 4 tokens
    assert "mean@4" in proc.stdout and "end" in proc.stdout and "answered=1.00" in proc.stdout


def test_eval_env_tool_numbers_equal_the_episodes(smol_dir, tmp_path, eval_inproc):
    spec = ("calculator:heldout_size=4,max_turns=3,max_new_tokens=5,truncated_turn=close,"
            "tool_format=test_eval_even_calls,tool_workers=1,max_total_tokens=1024")
    proc, (set_line, env_line), rows = _run(eval_inproc, smol_dir, tmp_path, "--env", spec, "--set", "arithmetic",
                                            "--num-prompts", "2")  # a set and an environment in one call
    assert set_line["set"] == "arithmetic" and set_line["num_prompts"] == 2 and "env" not in set_line
    assert [r["set"] for r in rows if "set" in r] == ["arithmetic"] * 2
    assert env_line["num_prompts"] == 2 and env_line["env_config"]["tool_format"] == "test_eval_even_calls"
    episodes = [e for r in rows if "env" in r for e in r["episodes"]]
    assert len(episodes) == 2 * N
    assert all(e["turns"] == 3 and e["tool_calls"] == 3 and e["termination"] == "max_turns" for e in episodes)
    # each episode's last two tool messages answer its own calls (the prompt's demonstration holds another)
    results = [c for e in episodes for c in [m["content"] for m in e["messages"] if m["role"] == "tool"][-2:]]
    valid = sum(e["valid_tool_calls"] for e in episodes)
    assert valid == sum(c == "5" for c in results) and len(results) == 2 * len(episodes)
    assert all(c == "5" or c.startswith("Error") for c in results)
    assert 0 < valid < len(results)  # both kinds occur (seeded), so the rate is not a constant
    assert env_line["valid_tool_call_rate"] == pytest.approx(valid / (3 * len(episodes)))
    assert env_line["turns"] == 3.0 and env_line["tool_calls"] == 3.0 and env_line["end_max_turns"] == 1.0
    assert env_line["mean_at_n"] == 0.0 and env_line["success"] == 0.0


def test_eval_env_bad_spec_is_one_line_before_the_model_loads(tmp_path, eval_inproc):
    cases = {
        "nosuch_env": "--env 'nosuch_env': ",
        "calculator:max_turns=0": "--env 'calculator:max_turns=0': env.max_turns=0 must be >= 1",
        "calculator:bogus=1": "--env 'calculator:bogus=1': env='calculator': unknown key(s) ['bogus']",
    }
    for spec, start in cases.items():
        proc = eval_inproc(str(tmp_path / "no_model"), "--env", spec, "--out", str(tmp_path / "x.jsonl"))
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and err[-1].startswith("mcore-rl-eval: error: " + start), err
        if spec == "nosuch_env":
            assert "calculator" in err[-1] and "retry" in err[-1]  # the registered names
    assert not (tmp_path / "x.jsonl").exists()
