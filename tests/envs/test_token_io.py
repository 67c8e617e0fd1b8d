"""Token-in, token-out: a 3-turn episode's trained ids are, token for token, what the engine was fed and produced.

Real LocalEngine (tiny random models) behind the real SmolLM2 chat template and a Qwen2.5-style template. Turns
between model replies are environment feedback (`retry`) or tool results from the sandboxed pool (an
environment registered here whose every reply counts as a `calc` call: random weights never spell one).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch

from mcore_rl.envs import ENVS, Feedback, build_environment
from mcore_rl.envs.calculator import CalculatorConfig, CalculatorEnv
from mcore_rl.envs.chat import TurnRenderer
from mcore_rl.envs.runner import EpisodeRunner
from mcore_rl.envs.tool_calls import TOOL_FORMATS, ToolCall
from mcore_rl.rollout.local.engine import LocalEngine
from mcore_rl.rollout.protocol import SamplingParams

EXPR, VALUE = "48213*77-19", "3712382"


@TOOL_FORMATS.register("test_every_reply_calls")
def _every_reply_calls(reply: str) -> list[ToolCall]:
    return [ToolCall("calc", {"expression": EXPR})]


@ENVS.register("test_tool_loop")
class ToolLoopEnv(CalculatorEnv):
    """calculator's prompts and tool; the reply is never judged because every reply calls the tool."""

    def respond(self, episode, reply: str) -> Feedback:
        # unreachable: the parser above makes every reply a tool call
        raise AssertionError("a reply without a tool call")


@dataclass
class Seen:
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]


class RecordingEngine:
    """The real engine, with every request and sample written down as the engine saw them."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine, self.seen, self._lock = engine, {}, threading.Lock()

    def submit(self, requests):
        futures = self.engine.submit(requests)
        for f in futures:
            f.add_done_callback(self._record)
        return futures

    def _record(self, f) -> None:
        s = f.result()
        with self._lock:
            self.seen[s.rid] = Seen(
                list(s.prompt_ids), list(s.output_ids), list(s.output_logprobs), list(s.weight_versions)
            )

    def turns(self, traj) -> list[Seen]:
        return [self.seen[f"{traj.metadata['rid']}/t{k}"] for k in range(1, traj.turns + 1)]


@pytest.fixture(scope="module", params=["smol", "qwen"])
def engine(request):
    folder = request.getfixturevalue(f"{request.param}_dir")
    torch.set_num_threads(2)
    eng = LocalEngine(str(folder), device="cpu", seed=0)
    eng.template = request.param
    yield eng
    eng.close()


def check_ids(traj, seen: list[Seen], renderer: TurnRenderer) -> None:
    ids, mask = traj.token_ids, traj.mask
    assert len(ids) == len(mask) == len(traj.logprobs) == len(traj.versions)
    assert traj.prompt_len == len(seen[0].prompt_ids)
    policy = set()
    for (start, end), s in zip(traj.turn_spans, seen):
        assert ids[:start] == s.prompt_ids  # fed: exactly the trajectory so far
        assert ids[start:end] == s.output_ids  # produced: kept as is, never re-tokenized
        assert traj.logprobs[start:end] == s.logprobs and traj.versions[start:end] == s.versions
        policy.update(range(start, end))
    assert [i for i, m in enumerate(mask) if m] == sorted(policy)
    assert all(traj.logprobs[i] == 0.0 and traj.versions[i] == -1 for i in range(len(ids)) if i not in policy)
    last = seen[-1]
    tail = ids[len(last.prompt_ids) + len(last.output_ids) :]
    assert tail in ([], [renderer.eot_id])  # at most the end-of-turn token the runner wrote for a cut turn
    # The boundaries are the template's: decoding the ids gives the template's rendering of the conversation.
    text = renderer.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert renderer.render_text(traj.messages).rstrip("\n") == text


def test_three_feedback_turns_are_token_exact(engine):
    env = build_environment(
        {
            "name": "retry",
            "max_attempts": 3,
            "max_turns": 3,
            "max_new_tokens": 6,
            "truncated_turn": "close",
            "size": 4,
            "heldout_size": 0,
        }
    )
    rec = RecordingEngine(engine)
    renderer = TurnRenderer(engine.tokenizer)
    trajs = EpisodeRunner(env, rec, renderer).run(
        env.records("train")[:2], SamplingParams(temperature=1.0, seed=3), samples_per_prompt=2
    )
    assert len(trajs) == 4
    for traj in trajs:
        assert traj.turns == 3 and traj.termination == "out_of_attempts" and traj.reward == 0.0
        assert [m["role"] for m in traj.messages[-5:]] == [
            "assistant",
            "user",
            "assistant",
            "user",
            "assistant",
        ]
        check_ids(traj, rec.turns(traj), renderer)
        assert 0 < traj.policy_tokens < len(traj.token_ids) - traj.prompt_len  # feedback tokens in between
    assert max(engine.stats.batch_sizes) > 1  # the episodes' turns were batched together


def test_three_tool_turns_are_token_exact(engine):
    env = build_environment(
        {
            "name": "test_tool_loop",
            "tool_format": "test_every_reply_calls",
            "max_turns": 3,
            "max_new_tokens": 5,
            "truncated_turn": "close",
            "size": 2,
            "heldout_size": 0,
            "tool_workers": 1,
        }
    )
    assert isinstance(env.config, CalculatorConfig)
    rec = RecordingEngine(engine)
    renderer = TurnRenderer(engine.tokenizer, [t.schema() for t in env.tools])
    runner = EpisodeRunner(env, rec, renderer)
    try:
        trajs = runner.run(env.records("train"), SamplingParams(temperature=1.0, seed=5))
    finally:
        runner.tools.close()
    for traj in trajs:
        assert traj.turns == 3 and traj.termination == "max_turns"
        assert traj.tool_calls == 3 and traj.valid_tool_calls == 2  # the 3rd turn's call is never run
        first = len(env.records("train")[0].prompt)  # the prompt holds the demonstration's tool turn
        assert traj.messages[first - 3]["role"] == "tool"
        tool_msgs = [m for m in traj.messages[first:] if m["role"] == "tool"]
        assert [m["content"] for m in tool_msgs] == [VALUE, VALUE]
        check_ids(traj, rec.turns(traj), renderer)
        env_text = renderer.tok.decode(
            [t for t, m in zip(traj.token_ids[traj.prompt_len :], traj.mask[traj.prompt_len :]) if not m],
            skip_special_tokens=False,
        )
        assert env_text.count(VALUE) == 2
        if engine.template == "qwen":  # Qwen wraps results in a user turn
            assert env_text.count("<tool_response>") == 2 and "<|im_start|>tool" not in env_text
        else:
            assert env_text.count("<|im_start|>tool") == 2


def test_weight_update_between_turns_is_recorded_per_token(engine):
    """A version bump between turns (as an async weight update lands) shows in each turn's tokens, and only there."""
    env = build_environment(
        {"name": "retry", "max_attempts": 3, "max_turns": 3, "max_new_tokens": 4, "truncated_turn": "close"}
    )
    judge = env.respond

    def respond_then_update(episode, reply):
        engine.set_weight_version(engine.weight_version + 1)
        return judge(episode, reply)

    env.respond = respond_then_update
    start = engine.weight_version
    (traj,) = EpisodeRunner(env, engine, TurnRenderer(engine.tokenizer)).run(
        env.records("train")[:1], SamplingParams(temperature=1.0, seed=7)
    )
    assert [sorted({traj.versions[i] for i in range(a, b)}) for a, b in traj.turn_spans] == [
        [start],
        [start + 1],
        [start + 2],
    ]
    assert {v for v, m in zip(traj.versions, traj.mask) if not m} == {-1}
