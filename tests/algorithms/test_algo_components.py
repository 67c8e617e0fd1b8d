"""Advantages, overlong penalty, EWMA weights, pass-rate history, PPO-EWMA auto-reset, correction metrics."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.algorithms import (
    CorrectionConfig,
    EwmaWeights,
    PassRateHistory,
    compute_advantages,
    correction_weights,
    overlong_penalty,
)
from tests.algorithms.algo_testlib import build, make_rollout, run_step

pytestmark = pytest.mark.algorithms
D = torch.float64


def test_group_zscore_unbiased_and_singleton():
    r = torch.tensor([1.0, 0.0, 0.0, 3.0], dtype=D)
    res = compute_advantages(r, torch.tensor([5, 5, 5, 9]))
    std = torch.tensor([1.0, 0.0, 0.0]).std().item()                   # unbiased, 0.57735
    assert res.advantages[:3].tolist() == pytest.approx([(2 / 3) / (std + 1e-6), -(1 / 3) / (std + 1e-6),
                                                         -(1 / 3) / (std + 1e-6)], rel=1e-6)
    assert res.advantages[3].item() == pytest.approx(3.0 / (1 + 1e-6))    # size-1 group: mean 0, std 1
    filt = compute_advantages(r, torch.tensor([5, 5, 5, 9]), filter_zero_variance=True)
    assert filt.keep.tolist() == [True, True, True, False] and filt.advantages[3] == 0


@pytest.mark.parametrize("source", ["advantages", "rewards"])
def test_batch_std_normalisation(source):
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 2.0], dtype=D)
    gid = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])                # group 2 is zero-variance
    res = compute_advantages(r, gid, std_norm="batch", filter_zero_variance=True, batch_std_source=source)
    centred = torch.tensor([2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3], dtype=D)
    spread = (centred if source == "advantages" else r[:6]).std()
    assert torch.allclose(res.advantages[:6].to(D), centred / (spread + 1e-6), rtol=1e-6)
    assert (res.advantages[6:] == 0).all() and res.num_zero_variance_groups == 1


def test_overlong_penalty_ramp():
    pen = overlong_penalty(torch.tensor([10, 12, 14, 16, 20]), max_len=16, buffer_len=4, factor=0.5)
    assert pen.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -0.5])
    dapo = build("dapo", max_response_len=16, overlong_buffer_len=4)
    rewards, gid = torch.ones(4, dtype=D), torch.tensor([0, 0, 0, 0])
    res = dapo.advantages(rewards, gid, lengths=torch.tensor([4, 14, 16, 8]))
    assert res.keep.all() and res.advantages[2] < res.advantages[1] < res.advantages[0] == res.advantages[3]
    with pytest.raises(ValueError, match="needs response lengths"):
        dapo.advantages(rewards, gid)


def test_ewma_swap_state_dict_and_dtype():
    torch.manual_seed(0)
    params = [torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(5)]
    live = [p.clone() for p in params]
    ew = EwmaWeights(params, beta=0.75)
    assert ew.shadow[0].dtype == torch.float32
    for _ in range(3):
        for p in params:
            p.add_(1.0)
        ew.update(params)
        live = [p.clone() for p in params]
    expected = params[1].float() - 1.0 * (0.75 + 2 * 0.75 ** 2 + 3 * 0.75 ** 3) / (1 + 0.75 + 0.75 ** 2 + 0.75 ** 3)
    assert torch.allclose(ew.shadow[1], expected, atol=1e-5)
    with ew.swapped_in(params):
        assert torch.equal(params[1], ew.shadow[1])
    assert all(torch.equal(p, q) for p, q in zip(params, live))
    other = EwmaWeights([torch.zeros(3, 4), torch.zeros(5)], beta=0.1)
    other.load_state_dict(ew.state_dict())
    assert other.beta == 0.75 and other.weight == ew.weight and torch.equal(other.shadow[1], ew.shadow[1])
    with pytest.raises(ValueError, match="tensor 1: shape"):
        EwmaWeights([torch.zeros(3, 4), torch.zeros(6)], 0.5).load_state_dict(ew.state_dict())


def test_params_restored_and_swapped_undo_in_place_writes_even_on_error():
    from mcore_rl.utils import params_restored, params_swapped

    params = [torch.arange(6.0).view(2, 3), torch.ones(4)]
    live = [p.clone() for p in params]
    with pytest.raises(RuntimeError, match="mid-block"):
        with params_restored(params):
            params[0].mul_(-3.0)
            params[1].zero_()
            raise RuntimeError("mid-block")
    assert all(torch.equal(p, q) for p, q in zip(params, live))
    other = [torch.full((2, 3), 7.0), torch.full((4,), 2.0)]
    with pytest.raises(RuntimeError, match="mid-block"):
        with params_swapped(params, other):
            assert all(torch.equal(p, q) for p, q in zip(params, other))
            raise RuntimeError("mid-block")
    assert all(torch.equal(p, q) for p, q in zip(params, live))


def test_pass_rate_history_retires_and_round_trips():
    h = PassRateHistory(threshold=0.9)
    newly = h.update(["a"] * 10 + ["b"] * 10, [1.0] * 10 + [1.0] * 8 + [0.0] * 2)
    assert newly == ["a"] and h.is_retired("a") and not h.is_retired("b") and h.pass_rate("b") == 0.8
    h.update(["b"] * 10, torch.ones(10))
    assert h.is_retired("b") and h.pass_rate("b") == 0.9
    h.update(["a"] * 4, [0.0] * 4)
    assert h.is_retired("a")                                         # retirement is permanent
    state = h.state_dict()
    torch.save(state, buf := __import__("io").BytesIO())
    buf.seek(0)
    h2 = PassRateHistory()
    h2.load_state_dict(torch.load(buf, weights_only=True))
    assert h2.is_retired("a") and h2.is_retired("b") and h2.pass_rate("a") == pytest.approx(10 / 14)
    with pytest.raises(ValueError, match="2 prompt ids but 3 rewards"):
        h.update(["x", "y"], [1.0, 0.0, 1.0])


def test_correction_metrics_and_levels():
    train = torch.log(torch.tensor([[0.5, 2.0, 1.0], [1.0, 4.0, 7.0]], dtype=D))
    roll = torch.zeros_like(train)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=D)
    tok = correction_weights(train, roll, mask, CorrectionConfig(mode="tis", tis_max=3.0))
    w = torch.tensor([0.5, 2.0, 1.0, 1.0, 4.0], dtype=D)
    assert float(tok.metrics["rollout_is_mean"]) == pytest.approx(w.mean().item())
    assert float(tok.metrics["rollout_is_max"]) == 4.0 and float(tok.metrics["rollout_is_min"]) == 0.5
    assert float(tok.metrics["rollout_is_eff_sample_size"]) == pytest.approx(
        1 / ((w / w.mean()) ** 2).mean().item())
    assert float(tok.metrics["tis_clipfrac"]) == pytest.approx(1 / 5)
    seq = correction_weights(train, roll, mask, CorrectionConfig(mode="tis", level="sequence", tis_max=10.0))
    assert seq.weight[0].tolist() == pytest.approx([1.0] * 3) and seq.weight[1, 0].item() == pytest.approx(4.0)
    geo = correction_weights(train, roll, mask, CorrectionConfig(mode="tis", level="geometric", tis_max=10.0))
    assert geo.weight[1, 0].item() == pytest.approx(2.0)
    veto = correction_weights(train, roll + 10.0, mask, CorrectionConfig(mode="none", veto_threshold=1e-4))
    assert veto.keep.sum() == 0


def test_mismatch_metrics_in_loss():
    ro = make_rollout(seed=4)
    m = run_step(build("grpo"), ro).metrics[0]
    expected = ((ro.old_logp - ro.rollout_logp).abs() * ro.mask).sum() / ro.mask.sum()
    assert m["train_rollout_logprob_abs_diff"] == pytest.approx(float(expected), rel=1e-9)
    assert m["kl_loss"] > 0 and m["ent_mc"] > 0 and 0 <= m["pg_clipfrac"] <= 1
