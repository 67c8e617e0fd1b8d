"""The pieces of a partial rollout on their own: what `mask_stale` does to a batch's loss mask, how a carried
single-turn sample continues chunk by chunk, and that a carried sample or episode survives a checkpoint (plain
data through torch.save / torch.load(weights_only=True)) unchanged. The CLI runs are in test_partial_cli.py."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.algorithms.aggregation import aggregate
from mcore_rl.batch import build_rollout_batch
from mcore_rl.data.records import PromptRecord
from mcore_rl.envs.base import Episode
from mcore_rl.envs.runner import _Live
from mcore_rl.rollout.protocol import Sample
from mcore_rl.trainer.carried import Continuation, EpisodePart, Group
from mcore_rl.trainer.episodes import EpisodePrompt
from mcore_rl.trainer.prompts import Prompt
from mcore_rl.trainer.rounds import mask_stale_tokens


def _sample(prompt: list[int], out: list[int], versions: list[int], mask: list[int] | None = None) -> Sample:
    return Sample("r", prompt, out, [-0.5] * len(out), versions, "stop", output_mask=mask)


def test_mask_stale_zeroes_exactly_the_earlier_version_policy_tokens():
    samples = [
        _sample([1, 2], [3, 4, 5, 6], [1, 1, 2, 2]),  # carried: two tokens of version 1, two of version 2
        _sample([1, 2, 3], [7, 8, 9], [2, 2, 2]),  # fresh
        _sample(
            [1], [3, 4, 5, 6, 7], [0, -1, -1, 2, 2], mask=[1, 0, 0, 1, 1]
        ),  # an episode: tool tokens between
    ]
    rb = build_rollout_batch(samples, [1.0, 0.0, 1.0], [True, False, True], [0, 0, 0])
    before = rb.loss_mask.clone()
    assert mask_stale_tokens(rb, version=2) == 3
    changed = (before != rb.loss_mask).nonzero().tolist()
    assert changed == [[0, 2], [0, 3], [2, 1]]  # rows 0 and 2 at their version-0/1 positions, nothing else
    assert rb.loss_mask.sum().item() == before.sum().item() - 3 == 7.0
    # the loss's denominators count the trained tokens only: a token-mean of per-token values 1..L
    per_token = torch.arange(1.0, rb.tokens.shape[1] + 1).expand_as(rb.loss_mask)
    full = aggregate(per_token, before, rb.group_ids, "token-mean").item()
    masked = aggregate(per_token, rb.loss_mask, rb.group_ids, "token-mean").item()
    assert full == pytest.approx((3 + 4 + 5 + 6 + 4 + 5 + 6 + 2 + 5 + 6) / 10, rel=1e-6)
    assert masked == pytest.approx((5 + 6 + 4 + 5 + 6 + 5 + 6) / 7, rel=1e-6)
    assert mask_stale_tokens(rb, version=2) == 0  # idempotent


def test_a_continuation_resumes_from_its_tokens_with_the_budget_left():
    c = Continuation("g3#1", 1, 1234, [10, 11])
    req = c.request(cap=4, max_new_tokens=10, sp={"temperature": 1.0, "top_p": 1.0, "stop_token_ids": [0]})
    assert req.prompt_ids == [10, 11] and req.sampling.max_new_tokens == 4 and req.sampling.seed == 1234
    assert c.apply(Sample("x", [10, 11], [5, 6, 7, 8], [-1.0] * 4, [3] * 4, "length"), 10) and not c.finished
    assert not c.apply(
        Sample("x", [10, 11], [9], [-1.0], [4], "abort"), 10
    )  # an aborted chunk leaves no trace
    req = c.request(cap=4, max_new_tokens=10, sp={"temperature": 1.0, "top_p": 1.0, "stop_token_ids": [0]})
    assert req.prompt_ids == [10, 11, 5, 6, 7, 8] and req.sampling.seed != 1234 and req.rid == "g3#1/c1"
    assert req.metadata == {"routing_key": "g3#1"}  # every chunk to the worker that holds the sample's prefix
    c.apply(Sample("x", req.prompt_ids, [9, 9, 9, 9], [-2.0] * 4, [4] * 4, "length"), 10)
    req = c.request(cap=4, max_new_tokens=10, sp={"temperature": 1.0, "top_p": 1.0, "stop_token_ids": [0]})
    assert req.sampling.max_new_tokens == 2  # only what is left of max_new_tokens
    c.apply(Sample("x", req.prompt_ids, [1, 0], [-3.0] * 2, [5] * 2, "stop", matched_stop=0), 10)
    assert c.finished and c.finish == "stop"
    s = c.sample("g3", None)
    assert s.output_ids == [5, 6, 7, 8, 9, 9, 9, 9, 1, 0] and s.weight_versions == [3] * 4 + [4] * 4 + [5] * 2
    assert s.output_logprobs == [-1.0] * 4 + [-2.0] * 4 + [-3.0] * 2 and s.sample_index == 1 and s.rid == "g3"
    assert c.restart() == 10 and c.out == [] and not c.finished


def _roundtrip(obj, tmp_path):
    torch.save(obj, tmp_path / "x.pt")
    return torch.load(tmp_path / "x.pt", weights_only=True)


def test_carried_groups_survive_a_checkpoint(tmp_path):
    prompt = Prompt("p7", [10, 11], "7")
    c = Continuation("g0#0", 0, 99, [10, 11], out=[5, 6], logprobs=[-0.25, -0.5], versions=[2, 2], chunks=1)
    g = Group("g0", prompt, 99, 3, [c, Continuation("g0#1", 1, 100, [10, 11], finish="length", out=[1],
                                                       logprobs=[-1.0], versions=[1], chunks=1)])  # fmt: skip
    back = Group.from_state(_roundtrip(g.state(), tmp_path), {"p7": prompt}.__getitem__)
    assert back.state() == g.state() and back.age(4) == 3 and not back.complete

    rec = PromptRecord("calc-3", "add 12345 and 67890", "80235")
    ep = Episode(rec, 2, [{"role": "user", "content": "add"}, {"role": "assistant", "content": "#calc"}], turn=1,
                 attempts=0, state={"answer_given": None})  # fmt: skip
    live = _Live(ep, "g1#2", [1, 2, 3], 3)
    live.ids += [4, 5, 6, 7]
    live.mask += [1, 1, 0, 0]
    live.logprobs += [-0.1, -0.2, 0.0, 0.0]
    live.versions += [5, 5, -1, -1]
    live.turn_spans, live.turn_rewards, live.tool_calls, live.valid_tool_calls = [(3, 5)], [0.0], 1, 1
    live.tool_reasons = {"ok": 1}
    part = EpisodePart("g1#2", 2, 77, live)
    eg = Group("g1", EpisodePrompt("calc-3", [1, 2, 3], "80235", record=rec), 77, 2, [part])
    back = Group.from_state(_roundtrip(eg.state(), tmp_path), {"calc-3": eg.prompt}.__getitem__)
    assert back.state() == eg.state()
    lv = back.parts[0].live
    assert lv.episode.record is rec and lv.termination is None and back.parts[0].policy_versions == [5, 5]
    s = back.parts[0].sample("g1")
    assert (
        s.output_ids == [4, 5, 6, 7] and s.output_mask == [1, 1, 0, 0] and s.weight_versions == [5, 5, -1, -1]
    )
