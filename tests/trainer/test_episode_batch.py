"""An episode as a trainer sample: packing it through `trajectory_sample` and the trainer's batch builder gives
exactly the tensors `trajectory_tensors` gives (mask holes on tool tokens, per-token log-probs and versions), and
the per-turn rules that read those tensors: interrupt's one-version-per-turn check, async staleness over policy
tokens only."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.batch import build_rollout_batch
from mcore_rl.envs import Trajectory
from mcore_rl.envs.batch import episode_metrics, summary_metrics, trajectory_sample, trajectory_tensors
from mcore_rl.oldlogp.interrupt import check_single_version, turn_spans
from mcore_rl.trainer.schedule.pipeline import staleness


def _traj(
    prompt: list[int], turns: list[tuple[list[int], list[int]]], reward: float, i: int = 0
) -> Trajectory:
    """turns: (model ids, tool ids after them); model tokens get log-prob -0.1*k and version = turn index."""
    ids, mask, lp, ver, spans = list(prompt), [0] * len(prompt), [0.0] * len(prompt), [-1] * len(prompt), []
    for t, (model, tool) in enumerate(turns):
        spans.append((len(ids), len(ids) + len(model)))
        ids += model
        mask += [1] * len(model)
        lp += [-0.1 * (k + 1) for k in range(len(model))]
        ver += [t + 3] * len(model)
        ids += tool
        mask += [0] * len(tool)
        lp += [0.0] * len(tool)
        ver += [-1] * len(tool)
    return Trajectory(f"p{i}", i, ids, mask, lp, ver, len(prompt), spans, [0.0] * len(turns), reward, reward > 0,
                      tool_calls=len(turns) - 1, valid_tool_calls=len(turns) - 1, termination="answered",
                      messages=[{"role": "assistant", "content": "x"}], metadata={"rid": f"r{i}"})  # fmt: skip


def test_episode_sample_packs_like_trajectory_tensors():
    trajs = [_traj([1, 2, 3], [([10, 11], [50, 51, 52]), ([12], [53]), ([13, 14, 15], [])], 1.0, 0),
             _traj([4, 5], [([20], [60])], 0.0, 1)]  # fmt: skip
    samples = [trajectory_sample(t) for t in trajs]
    assert samples[0].output_mask == [1, 1, 0, 0, 0, 1, 0, 1, 1, 1]
    rb = build_rollout_batch(samples, [t.reward for t in trajs], [t.correct for t in trajs], [0, 0])
    ref = trajectory_tensors(trajs, [0, 0])
    for name in ("tokens", "loss_mask", "rollout_logp", "versions", "response_len", "rewards"):
        assert torch.equal(getattr(rb, name), ref[name]), name
    assert rb.response_len.tolist() == [6.0, 1.0]  # policy tokens only
    eps = [s.metadata["episode"] for s in samples]
    assert summary_metrics(eps) == episode_metrics(trajs)
    assert (
        summary_metrics(eps)["env/turns"] == 2.0 and summary_metrics(eps)["env/policy_token_frac"] == 7 / 12
    )


def test_interrupt_check_is_per_turn():
    t = _traj([1, 2], [([10, 11], [50]), ([12, 13], [51])], 1.0)  # turn 0 at version 3, turn 1 at version 4
    rb = build_rollout_batch([trajectory_sample(t)], [1.0], [True], [0])
    assert turn_spans(rb.loss_mask[0]) == [(2, 4), (5, 7)]
    check_single_version(rb)  # two versions in one episode, one per turn: what interrupt mode produces
    rb.versions[0, 6] = 5  # a turn holding two versions: the engine did not restart it
    with pytest.raises(RuntimeError, match="rows \\[0\\] have a turn that spans several weight versions"):
        check_single_version(rb)


def test_async_staleness_reads_policy_tokens_only():
    s = trajectory_sample(_traj([1, 2], [([10], [50, 51]), ([12], [])], 1.0))  # versions 3, -1, -1, 4
    assert s.weight_versions == [3, -1, -1, 4]
    assert staleness(6, [s]) == 3  # the oldest policy token (version 3), not a tool token's -1
