"""RLOO and REINFORCE++ against hand computations: leave-one-out advantages, RLOO's per-response ratio, REINFORCE++'s
token-weighted global whitening (two emulated DP ranks = one process), its token-level KL return with tool-token
holes, and the config refusals. Micro-batch split invariance and loss masks: test_algo_split.py and
tests/envs/test_loss_mask.py (both iterate the registry)."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from mcore_rl.algorithms import build_algorithm
from mcore_rl.algorithms.reinforce_pp import kl_estimate, kl_returns, token_whiten
from mcore_rl.config.checks import ConfigError
from tests.algorithms.algo_testlib import Rollout, build, make_rollout, run_step

pytestmark = pytest.mark.algorithms
D = torch.float64


def rollout(mask: list[list[float]], rewards: list[float], groups: list[int], logp, old, ref) -> Rollout:
    m = torch.tensor(mask, dtype=D)
    t = lambda x: torch.tensor(x, dtype=D)  # noqa: E731
    return Rollout(t(rewards), torch.tensor(groups), m, t(logp), t(old), t(old), t(old), t(ref), torch.zeros_like(m))


# ---- RLOO ----------------------------------------------------------------------------------------------------
def test_rloo_leave_one_out_on_two_groups():
    # group 7: rewards 1, 0, 0 (interleaved with group 2: 2, 4); A_i = R_i - mean of the others
    rewards = torch.tensor([1.0, 2.0, 0.0, 4.0, 0.0])
    gid = torch.tensor([7, 2, 7, 2, 7])
    hand = torch.tensor([1.0 - 0.0, 2.0 - 4.0, 0.0 - 0.5, 4.0 - 2.0, 0.0 - 0.5])
    res = build("rloo").advantages(rewards, gid)
    assert torch.allclose(res.advantages, hand, atol=1e-7)
    mean_form = torch.tensor([3 / 2 * (1 - 1 / 3), 2.0 * (2 - 3), 3 / 2 * (0 - 1 / 3), 2.0 * (4 - 3), 3 / 2 * (-1 / 3)])
    assert torch.allclose(res.advantages, mean_form.float(), atol=1e-7)  # = G/(G-1) (R_i - mean_G R)
    assert res.keep.all() and res.metrics["adv_mean"] == pytest.approx(0.0, abs=1e-7)
    batch = build("rloo", adv_std_norm="batch").advantages(rewards, gid)
    assert torch.allclose(batch.advantages, hand / (hand.std() + 1e-6), atol=1e-6)  # TRL's normalize_advantages
    scaled = build("rloo").advantages(3 * rewards + 5, gid).advantages
    assert torch.allclose(scaled, 3 * hand, atol=1e-6)  # reward scale kept, offsets cancel


def test_rloo_refuses_a_group_of_one_in_one_line():
    with pytest.raises(ConfigError, match=r"^algorithm 'rloo': a prompt group of one response has no baseline "
                                          r".*trainer.samples_per_prompt >= 2$"):
        build("rloo").advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]))
    with pytest.raises(ConfigError, match=r"baseline=group"):
        build("reinforce_pp", baseline="group").advantages(torch.tensor([1.0]), torch.tensor([0]),
                                                            lengths=torch.tensor([3.0]))


def test_rloo_one_ratio_per_response_against_a_hand_computation():
    # two responses of one group, token-level log-ratios summing to +0.5 (rho = e^0.5 > 1.2: clipped, A > 0) and
    # -0.1 (rho inside the clip range); the third token of row 1 is a tool token (mask 0)
    logp = [[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]]
    old = [[-1.2, -2.3, -0.5], [-1.45, -0.65, -9.0]]
    ro = rollout([[1, 1, 1], [1, 1, 0]], [1.0, 0.0], [0, 0], logp, old, logp)
    res = run_step(build("rloo"), ro, splits=2)
    a = [1.0, -1.0]  # leave-one-out, G = 2
    rho = [math.exp(0.5), math.exp(-0.1)]
    per_seq = [max(-a[i] * rho[i], -a[i] * min(max(rho[i], 0.8), 1.2)) for i in range(2)]
    assert res.loss == pytest.approx(sum(per_seq) / 2, rel=1e-12)  # mean over responses
    grad = torch.zeros(2, 3, dtype=D)
    grad[1, :2] = -a[1] * rho[1] / 2  # row 0 is clipped: no gradient; row 1: -A rho / N on each policy token
    assert torch.allclose(res.grad_logp, grad, atol=1e-12)
    assert [m["pg_clipfrac"] for m in res.metrics] == [1.0, 0.0]  # one micro-batch per row: row 0 clipped


def test_rloo_on_policy_is_the_unnormalised_reinforce_gradient():
    ro = make_rollout(seed=4)
    ro.old_logp = ro.logp.clone()
    alg = build("rloo")
    adv = alg.advantages(ro.rewards, ro.group_ids).advantages.to(D)
    res = run_step(alg, ro, splits=3)
    n_seq = int((ro.mask.sum(1) > 0).sum())
    assert torch.allclose(res.grad_logp, -adv[:, None] * ro.mask / n_seq, atol=1e-12)
    token = run_step(build("rloo", ratio_level="token"), ro, splits=3)  # GRPO's surrogate: length-normalised
    assert torch.allclose(token.grad_logp, -adv[:, None] * ro.mask / ro.mask.sum(1, keepdim=True) / n_seq,
                          atol=1e-12)


def test_rloo_token_level_is_grpos_surrogate():
    ro = make_rollout(seed=9)
    adv = torch.linspace(-1, 1, ro.mask.shape[0], dtype=D)
    got = run_step(build("rloo", ratio_level="token"), ro, splits=2, adv=adv)
    want = run_step(build("grpo", kl_coef=0.0), ro, splits=2, adv=adv)
    assert torch.allclose(got.grad_logp, want.grad_logp, atol=1e-15) and got.loss == pytest.approx(want.loss)


# ---- REINFORCE++ ---------------------------------------------------------------------------------------------
def test_reinforce_pp_whitening_by_hand():
    rewards, lengths = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([3.0, 2.0, 1.0, 4.0])
    gid = torch.tensor([0, 0, 1, 1])
    res = build("reinforce_pp").advantages(rewards, gid, lengths=lengths)
    mu = (3 + 1 + 4) / 10  # token-weighted: each response counts once per policy token
    sigma = math.sqrt((3 * (1 - mu) ** 2 + 2 * mu**2 + 1 * (1 - mu) ** 2 + 4 * (1 - mu) ** 2) / 10) + 1e-6
    assert torch.allclose(res.advantages.double(), (rewards.double() - mu) / sigma, atol=1e-6)
    assert res.metrics["whiten_mean"] == pytest.approx(mu) and res.metrics["whiten_std"] == pytest.approx(sigma)
    # baseline=group: group means (2/3 -> by count: 0.5, and 1.0) first, then the same whitening
    base = build("reinforce_pp", baseline="group").advantages(rewards, gid, lengths=lengths)
    a = torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=D)
    mu_a = float((a * lengths).sum() / 10)
    sd_a = math.sqrt(float((lengths * (a - mu_a) ** 2).sum() / 10)) + 1e-6
    assert torch.allclose(base.advantages.double(), (a - mu_a) / sd_a, atol=1e-6)
    centred = build("reinforce_pp", adv_std_norm="none").advantages(rewards, gid, lengths=lengths)
    assert torch.allclose(centred.advantages.double(), rewards.double() - mu, atol=1e-7)


class TwoRanks:
    """Two 'DP ranks' as threads: a SUM all-reduce through a barrier, the Reducer contract without gloo."""

    def __init__(self) -> None:
        self.barrier, self.slots = threading.Barrier(2, timeout=60), [None, None]

    def reducer(self, rank: int):
        def reduce(x: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = x.clone()
            self.barrier.wait()
            out = self.slots[0] + self.slots[1]
            self.barrier.wait()
            return out

        return reduce


@pytest.mark.parametrize("kw", [{}, {"baseline": "group", "reward_kl_estimator": "k2", "loss_agg_mode": "prompt-mean"},
                                {"reward_kl_coef": 0.0, "eps_low": 0.1}])
def test_reinforce_pp_two_emulated_ranks_equal_one_process(kw):
    ro, kw = make_rollout(seed=21), {"reward_kl_coef": 0.3, **kw}
    one_alg = build("reinforce_pp", **kw)
    one = run_step(one_alg, ro)
    half = ro.mask.shape[0] // 2 // 4 * 4  # whole groups of 4 per rank, unequal token counts
    parts, ranks, out = [ro.rows(slice(0, half)), ro.rows(slice(half, None))], TwoRanks(), [None, None]
    algs = [build("reinforce_pp", **kw) for _ in range(2)]

    def worker(r: int) -> None:
        out[r] = run_step(algs[r], parts[r], splits=2, reduce=ranks.reducer(r))

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert one.grad_logp.abs().max() > 0
    assert torch.allclose(torch.cat([out[0].grad_logp, out[1].grad_logp]), one.grad_logp, atol=1e-12)
    assert out[0].loss + out[1].loss == pytest.approx(one.loss, abs=1e-12)


def test_token_whiten_reduces_once_over_ranks():
    calls = []
    v, n = torch.tensor([1.0, -2.0]), torch.tensor([2.0, 0.0])  # an empty response counts nowhere
    white, mu, scale = token_whiten(v, n, torch.tensor([True, True]), lambda x: calls.append(x) or x)
    assert len(calls) == 1 and mu == 1.0 and scale == pytest.approx(1e-6) and white[0] == 0.0


def test_kl_return_with_a_tool_token_by_hand():
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0]])  # a tool token at 2, padding at 4
    old = torch.tensor([[-1.0, -2.0, -0.5, -0.7, -1.0]], dtype=D)
    ref = old - torch.tensor([[0.1, -0.2, 5.0, 0.3, 7.0]], dtype=D)  # log pi_old - log pi_ref
    k1 = kl_estimate(old, ref, mask, "k1")
    assert torch.allclose(k1, torch.tensor([[0.1, -0.2, 0.0, 0.3, 0.0]], dtype=D), atol=1e-15)
    assert torch.allclose(kl_returns(k1, mask), torch.tensor([[0.2, 0.1, 0.3, 0.3, 0.0]], dtype=D), atol=1e-15)
    k2 = kl_returns(kl_estimate(old, ref, mask, "k2"), mask)
    assert torch.allclose(k2, torch.tensor([[0.07, 0.065, 0.045, 0.045, 0.0]], dtype=D), atol=1e-15)
    k3 = kl_estimate(old, ref, mask, "k3")
    assert torch.allclose(k3[0, :2], torch.exp(-torch.tensor([0.1, -0.2], dtype=D)) - 1 + torch.tensor([0.1, -0.2]))


def test_reinforce_pp_loss_charges_each_token_its_kl_return():
    # on-policy (ratio 1, no clip), token-mean over 5 policy tokens: dL/dlogp_t = -A_t / 5 with
    # A_t = (R_i - mu) / sigma - beta * K_t, K_t the k1 return; the tool token (mask 0) gets nothing
    old = [[-1.0, -2.0, -0.5, -0.7], [-0.3, -1.1, -2.0, -2.0]]
    x = [[0.1, -0.2, 5.0, 0.3], [0.4, 0.2, 0.0, 0.0]]
    ref = [[o - d for o, d in zip(ro, rx)] for ro, rx in zip(old, x)]
    ro = rollout([[1, 1, 0, 1], [1, 1, 0, 0]], [1.0, 0.0], [0, 0], old, old, ref)
    alg = build("reinforce_pp", reward_kl_coef=0.5)
    res = run_step(alg, ro, splits=2)
    mu = 3 / 5  # token-weighted mean reward
    sigma = math.sqrt((3 * (1 - mu) ** 2 + 2 * mu**2) / 5) + 1e-6
    k = torch.tensor([[0.2, 0.1, 0.3, 0.3], [0.6, 0.2, 0.0, 0.0]], dtype=D)
    a_tok = torch.tensor([[1 - mu], [-mu]], dtype=D) / sigma - 0.5 * k
    assert torch.allclose(res.grad_logp, -a_tok * ro.mask / 5, atol=1e-9)
    assert res.metrics[0]["reward_kl"] == pytest.approx(0.2 / 3)  # mean k1 over micro-batch 0's policy tokens
    assert alg.needs_ref_logp and not build("reinforce_pp", reward_kl_coef=0.0).needs_ref_logp
    # every outcome equal (sigma = 0): the whitened outcome is 0 and the KL return keeps its size beta * K_t
    ro.rewards = torch.tensor([1.0, 1.0], dtype=D)
    flat = run_step(build("reinforce_pp", reward_kl_coef=0.5), ro, splits=1)
    assert torch.allclose(flat.grad_logp, 0.5 * k * ro.mask / 5, atol=1e-12)


def test_inert_rows_keep_kl_charged_rows():
    adv, w = torch.tensor([0.0, 1.0, 0.0]), torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    assert build("reinforce_pp").inert_rows(adv, w).tolist() == [False, False, True]
    assert build("reinforce_pp", reward_kl_coef=0.0).inert_rows(adv, w).tolist() == [True, False, True]
    assert build("rloo").inert_rows(adv, w).tolist() == [True, False, True]


# ---- configs -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg,match", [
    ({"name": "rloo", "ratio_level": "prefix"}, r"ratio_level='prefix'"),
    ({"name": "rloo", "adv_std_norm": "group"}, r"algorithm 'rloo'.*adv_std_norm='group'"),
    ({"name": "reinforce_pp", "baseline": "median"}, r"baseline='median'"),
    ({"name": "reinforce_pp", "reward_kl_estimator": "k4"}, r"reward_kl_estimator='k4'"),
    ({"name": "reinforce_pp", "reward_kl_coef": -0.1}, r"reward_kl_coef must be >= 0"),
    ({"name": "reinforce_pp", "adv_std_norm": "group"}, r"algorithm 'reinforce_pp'.*adv_std_norm='group'"),
])  # fmt: skip
def test_bad_configs_name_the_key(cfg, match):
    with pytest.raises(ValueError, match=match):
        build_algorithm(cfg)


def test_reinforce_pp_needs_lengths_and_defaults():
    with pytest.raises(ValueError, match="needs response lengths"):
        build("reinforce_pp").advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))
    c = build("reinforce_pp").config
    assert (c.reward_kl_coef, c.reward_kl_estimator, c.kl_coef, c.loss_agg_mode, c.baseline, c.eps_low,
            c.eps_high) == (0.01, "k1", 0.0, "token-mean", "none", 0.2, 0.2)
    r = build("rloo").config
    assert (r.ratio_level, r.loss_agg_mode, r.adv_std_norm, r.kl_coef, r.updates_per_rollout) == (
        "sequence", "seq-mean-token-mean", "none", 0.0, 1)
