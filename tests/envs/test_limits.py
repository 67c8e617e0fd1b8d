"""Episode limits and bad calls through the real engine: per-turn call cap, token budget, cut turns, bad JSON."""

from __future__ import annotations

import threading
import time

import pytest

from mcore_rl.envs import build_environment
from mcore_rl.envs.chat import TurnRenderer
from mcore_rl.envs.runner import EpisodeRunner
from mcore_rl.envs.tool_calls import TOOL_FORMATS, ToolCall
from mcore_rl.rollout.local.engine import LocalEngine
from mcore_rl.rollout.protocol import SamplingParams
from tests.envs import test_token_io  # noqa: F401  (registers the test_tool_loop environment)


@TOOL_FORMATS.register("test_two_calls_one_bad")
def _two_calls_one_bad(reply: str) -> list[ToolCall]:
    return [ToolCall("", error="invalid JSON in tool call (test)"), ToolCall("calc", {"expression": "2+3"})]


@pytest.fixture(scope="module")
def engine(smol_dir):
    eng = LocalEngine(str(smol_dir), device="cpu", seed=0)
    yield eng
    eng.close()


def _run(engine, **cfg):
    env = build_environment(
        {
            "name": "test_tool_loop",
            "size": 2,
            "heldout_size": 0,
            "tool_workers": 1,
            "demonstration": False,
            **cfg,
        }
    )
    renderer = TurnRenderer(engine.tokenizer, [t.schema() for t in env.tools])
    runner = EpisodeRunner(env, engine, renderer)
    try:
        return runner.run(env.records("train"), SamplingParams(temperature=1.0, seed=11)), renderer
    finally:
        runner.tools.close()


def test_bad_json_and_calls_past_the_cap_get_error_messages(engine):
    trajs, _ = _run(
        engine,
        tool_format="test_two_calls_one_bad",
        max_tool_calls_per_turn=1,
        max_turns=2,
        max_new_tokens=4,
        truncated_turn="close",
    )
    for t in trajs:
        assert t.turns == 2 and t.termination == "max_turns"
        assert (
            t.tool_calls == 4 and t.valid_tool_calls == 0
        )  # turn 1: one malformed, one refused; turn 2 not run
        tool_text = [m["content"] for m in t.messages if m["role"] == "tool"]
        assert tool_text == [
            "Error: malformed tool call: invalid JSON in tool call (test)",
            "Error: at most 1 tool calls per turn",
        ]
        assert t.metadata["tool_results"] == {"malformed": 1, "too_many_calls": 1}


def test_token_budget_ends_the_episode_within_it(engine):
    trajs, _ = _run(
        engine,
        tool_format="test_every_reply_calls",
        max_turns=10,
        max_new_tokens=8,
        truncated_turn="close",
        max_total_tokens=260,
    )
    for t in trajs:
        assert t.termination == "max_total_tokens" and len(t.token_ids) <= 260
        assert 1 <= t.turns < 10


def test_a_cut_turn_ends_the_episode_by_default(engine):
    trajs, renderer = _run(engine, tool_format="test_every_reply_calls", max_turns=3, max_new_tokens=3)
    cut = [t for t in trajs if t.token_ids[t.turn_spans[0][1] - 1] != renderer.eot_id]
    assert cut  # random weights rarely end a turn within 3 tokens
    for t in cut:
        assert t.termination == "length" and t.turns == 1 and t.tool_calls == 0
        assert len(t.token_ids) == t.turn_spans[0][1]  # nothing written after the cut


def test_an_abort_mid_turn_ends_episodes_with_what_was_generated(engine):
    """engine.abort() (a pause for a weight update in abort mode) ends the episode; its tokens stay consistent."""
    env = build_environment({"name": "retry", "size": 3, "max_new_tokens": 400, "max_total_tokens": 600})
    out: list = []
    worker = threading.Thread(
        target=lambda: out.extend(
            EpisodeRunner(env, engine, TurnRenderer(engine.tokenizer)).run(
                env.records("train"), SamplingParams(temperature=1.0, seed=1, stop_token_ids=[])
            )
        )
    )
    worker.start()
    deadline = time.monotonic() + 60
    while engine.num_running == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.abort(None)
    worker.join(timeout=60)
    assert len(out) == 3
    for t in out:
        if t.termination != "abort":  # it finished before the abort (an early end-of-turn): nothing to check
            continue
        assert t.turns == 1 and sum(t.mask) == t.turn_spans[0][1] - t.turn_spans[0][0] < 400
    assert any(t.termination == "abort" for t in out)


def test_an_environment_error_raises_and_leaves_no_turn_decoding(engine):
    from mcore_rl.envs import Feedback

    env = build_environment(
        {"name": "retry", "size": 4, "max_new_tokens": 2, "truncated_turn": "close", "max_total_tokens": 900}
    )
    env.respond = lambda episode, reply: Feedback(0.0, False)  # forgets the messages for the model
    with pytest.raises(ValueError, match=r"env 'retry': respond\(\) returned done=False without messages"):
        EpisodeRunner(env, engine, TurnRenderer(engine.tokenizer)).run(
            env.records("train"), SamplingParams(temperature=1.0, seed=4, max_new_tokens=2)
        )
    deadline = time.monotonic() + 30
    while engine.num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.num_running == 0


def _update_when_decoding(engine, version: int, min_tokens: int) -> threading.Thread:
    """Load the same weights under `version` once a turn is decoding and has `min_tokens` tokens (an async update
    landing inside a turn)."""

    def go() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            rows = [r for r in engine._batch.rows if r.finish is None]
            if rows and len(rows[0].out) >= min_tokens:
                break
            time.sleep(0.002)
        engine.update_weights(((n, p.detach().clone()) for n, p in engine.model.named_parameters()), version)

    t = threading.Thread(target=go)
    t.start()
    return t


@pytest.mark.parametrize("interrupt", [False, True])
def test_an_update_inside_a_turn_restarts_only_that_turn_in_interrupt_mode(engine, interrupt):
    env = build_environment(
        {"name": "retry", "max_attempts": 2, "max_new_tokens": 64, "truncated_turn": "close"}
    )
    v0 = engine.weight_version
    judge, updates = env.respond, []

    def respond(episode, reply):  # between turn 1 and turn 2: arm an update that lands inside turn 2
        if not updates:
            updates.append(_update_when_decoding(engine, v0 + 1, min_tokens=4))
        return judge(episode, reply)

    env.respond = respond
    engine.set_interrupt_on_update(interrupt)
    regenerated = engine.stats.regenerated
    try:
        (traj,) = EpisodeRunner(env, engine, TurnRenderer(engine.tokenizer)).run(
            env.records("train")[:1], SamplingParams(temperature=1.0, seed=21, stop_token_ids=[])
        )
    finally:
        engine.set_interrupt_on_update(False)
        for t in updates:
            t.join()
    (a1, b1), (a2, b2) = traj.turn_spans
    assert set(traj.versions[a1:b1]) == {v0}  # the earlier turn is never touched
    if interrupt:  # the turn restarted from its own prompt: all of it under the new version
        assert set(traj.versions[a2:b2]) == {v0 + 1} and engine.stats.regenerated == regenerated + 1
    else:  # without interrupt the turn carries both versions, token by token
        assert set(traj.versions[a2:b2]) == {v0, v0 + 1}
