"""GSPO and GSPO-token against the paper's formulas written out by hand (arXiv 2507.18071).

The hand computation is plain Python over a small batch whose rows have environment holes (mask 0 inside a row),
padding and prompt groups: s_i = exp(mean over policy tokens of log pi_theta - log pi_old), the loss
sum_i W_i * -min(s_i A_i, clip(s_i) A_i) with W_i the row's aggregation weight (hand formulas per mode), and its
gradient. Then: GSPO-token equals GSPO with sequence advantages and differs with token ones, masked tokens change
nothing, the loss and step metrics are exact under micro-batch and (threaded) data-parallel splits, inert rows,
the paper's defaults, the config checks and the CLI override strings.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

from mcore_rl.algorithms import AGG_MODES, TokenBatch
from tests.algorithms.algo_testlib import Rollout, build, make_rollout, run_step

pytestmark = pytest.mark.algorithms
D = torch.float64
L_MAX = 10
EPS = (0.2, 0.28)  # wide enough that a hand batch has clipped and unclipped rows of both signs


def hand_batch() -> tuple[Rollout, torch.Tensor]:
    """6 rows, 3 prompt groups (non-contiguous ids), holes and padding with junk; row-mean log-ratios chosen so that
    rows 1 and 2 are clipped (A > 0, s > 1.28; A < 0, s < 0.8) and the others are not."""
    g = torch.Generator().manual_seed(4)
    n, t = 6, 8
    mask = torch.zeros(n, t, dtype=D)
    layouts = [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 4, 5, 6], [0, 1, 2], [0, 3, 4, 5, 6, 7], [0, 1], [0, 2, 3, 4, 5]]
    for i, cols in enumerate(layouts):
        mask[i, cols] = 1.0
    logp = -torch.rand(n, t, generator=g, dtype=D) * 2 - 0.1
    shift = torch.tensor([0.05, 0.5, -0.5, 0.4, -0.4, 0.1], dtype=D)[:, None]
    old = logp - shift - 0.2 * torch.randn(n, t, generator=g, dtype=D)
    logp[mask == 0], old[mask == 0] = 3.0, -50.0  # junk where nothing is scored (holes, padding)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -0.5], dtype=D)
    z = torch.zeros(n, t, dtype=D)
    ro = Rollout(torch.zeros(n, dtype=D), torch.tensor([5, 5, 9, 9, 2, 2]), mask, logp, old.clone(), old, old.clone(),
                 old.clone(), z)
    return ro, adv


def row_weights(mask: torch.Tensor, groups: torch.Tensor, mode: str) -> list[float]:
    """W_i = sum_t w_it by hand: how much of row i's sequence loss the mode counts."""
    lens = [float(x) for x in mask.sum(dim=1)]
    n_seq, n_tok = sum(ln > 0 for ln in lens), sum(lens)
    gl = {int(k): sum(ln for ln, h in zip(lens, groups.tolist()) if h == k) for k in groups.tolist()}
    n_prompt = sum(v > 0 for v in gl.values())
    return [{"token-mean": ln / n_tok, "seq-mean-token-mean": 1.0 / n_seq,
             "prompt-mean": ln / gl[int(k)] / n_prompt, "seq-mean-token-sum-norm": ln / (n_seq * L_MAX)}[mode]
            for ln, k in zip(lens, groups.tolist())]


def hand_gspo(ro: Rollout, adv: torch.Tensor, mode: str, eps=EPS) -> tuple[float, torch.Tensor, list[bool]]:
    """The paper's GSPO loss (weighted by the mode), dL/dlogp and which rows the clip binds, in plain Python."""
    weights, lo, hi = row_weights(ro.mask, ro.group_ids, mode), 1 - eps[0], 1 + eps[1]
    loss, grad, clipped = 0.0, torch.zeros_like(ro.logp), []
    for i in range(ro.mask.shape[0]):
        cols = [t for t in range(ro.mask.shape[1]) if ro.mask[i, t] > 0]
        s = math.exp(sum(float(ro.logp[i, t] - ro.old_logp[i, t]) for t in cols) / len(cols))
        a = float(adv[i])
        unclipped, clip = -s * a, -min(max(s, lo), hi) * a
        loss += weights[i] * max(unclipped, clip)
        clipped.append(clip > unclipped)
        for t in cols:  # d s_i / d logp_it = s_i / |y_i|; no gradient where the clipped branch binds
            grad[i, t] = 0.0 if clip > unclipped else weights[i] * -a * s / len(cols)
    return loss, grad, clipped


def token_step(alg, ro: Rollout, adv_tok: torch.Tensor) -> tuple[float, torch.Tensor]:
    """One micro-batch with per-token advantages (run_step broadcasts one per row): loss and dL/dlogp."""
    logp = ro.logp.clone().requires_grad_(True)
    w = alg.token_weights(ro.mask, ro.group_ids)
    loss, _ = alg.loss(TokenBatch(logp=logp, mask=ro.mask, advantages=adv_tok, rollout_logp=ro.rollout_logp,
                                  token_weight=w, old_logp=ro.old_logp))
    loss.backward()
    alg.finish_accumulation()
    return float(loss), logp.grad


@pytest.mark.parametrize("variant", ["gspo", "gspo_token"])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_loss_and_gradient_equal_the_paper_by_hand(mode, variant):
    ro, adv = hand_batch()
    want, grad, clipped = hand_gspo(ro, adv, mode)
    assert clipped == [False, True, True, False, False, False]
    alg = build("gspo", loss_agg_mode=mode, max_response_len=L_MAX, eps_low=EPS[0], eps_high=EPS[1], variant=variant)
    res = run_step(alg, ro, splits=2, adv=adv)
    assert res.loss == pytest.approx(want, rel=1e-12)
    assert torch.allclose(res.grad_logp, grad, rtol=1e-10, atol=1e-15)
    assert float(res.grad_logp[ro.mask == 0].abs().max()) == 0.0
    assert res.step_metrics["seq_clipfrac"] == pytest.approx(2 / 6, abs=1e-15)
    ratios = [math.exp(float(((ro.logp[i] - ro.old_logp[i]) * ro.mask[i]).sum() / ro.mask[i].sum())) for i in range(6)]
    assert res.step_metrics["seq_ratio_mean"] == pytest.approx(sum(ratios) / 6, rel=1e-12)
    assert max(m["seq_ratio_max"] for m in res.metrics) == pytest.approx(max(ratios), rel=1e-12)
    assert min(m["seq_ratio_min"] for m in res.metrics) == pytest.approx(min(ratios), rel=1e-12)


def test_seq_mean_is_the_paper_mean_over_responses():
    """seq-mean-token-mean: -(1/G) sum_i min(s_i A_i, clip(s_i) A_i), G = every response of the batch."""
    ro, adv = hand_batch()
    terms = []
    for i in range(6):
        m = ro.mask[i] > 0
        s = math.exp(float((ro.logp[i] - ro.old_logp[i])[m].mean()))
        terms.append(min(s * float(adv[i]), min(max(s, 1 - EPS[0]), 1 + EPS[1]) * float(adv[i])))
    res = run_step(build("gspo", eps_low=EPS[0], eps_high=EPS[1]), ro, adv=adv)
    assert res.loss == pytest.approx(-sum(terms) / 6, rel=1e-12)


def test_paper_defaults_and_their_clip():
    """eps 3e-4 / 4e-4 (section 5.1), 4 mini-batches per rollout, no KL, the mean over responses."""
    c = build("gspo").config
    assert (c.eps_low, c.eps_high, c.updates_per_rollout, c.kl_coef, c.loss_agg_mode, c.variant) == (
        3e-4, 4e-4, 4, 0.0, "seq-mean-token-mean", "gspo")
    # one row of 4 tokens, A = 1: a mean log-ratio of 3e-4 is inside [1 - 3e-4, 1 + 4e-4], 5e-4 is clipped
    for mean_lr, inside in ((3e-4, True), (5e-4, False), (-2.9e-4, True)):
        logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], dtype=D, requires_grad=True)
        old = logp.detach() - mean_lr + torch.tensor([[0.01, -0.01, 0.02, -0.02]], dtype=D)
        m = torch.ones_like(old)
        alg = build("gspo")
        loss, metrics = alg.loss(TokenBatch(logp=logp, mask=m, advantages=m, rollout_logp=old, token_weight=m / 4,
                                            old_logp=old))
        loss.backward()
        assert metrics["seq_clipfrac"] == (0.0 if inside else 1.0)
        assert float(logp.grad.abs().max()) == (pytest.approx(math.exp(mean_lr) / 4, rel=1e-9) if inside else 0.0)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_gspo_token_equals_gspo_with_sequence_advantages(mode):
    ro = make_rollout(seed=13)
    kw = {"loss_agg_mode": mode, "max_response_len": 16, "eps_low": 0.05, "eps_high": 0.05}
    seq, tok = run_step(build("gspo", **kw), ro, splits=3), run_step(build("gspo", variant="gspo_token", **kw), ro)
    assert 0 < seq.step_metrics["seq_clipfrac"] < 1 and seq.grad_logp.abs().max() > 0
    assert tok.loss == pytest.approx(seq.loss, rel=1e-12, abs=1e-15)
    assert torch.allclose(tok.grad_logp, seq.grad_logp, rtol=1e-10, atol=1e-15)
    assert tok.step_metrics == pytest.approx(seq.step_metrics, rel=1e-12)


def test_token_advantages_separate_the_variants():
    """GSPO-token: d/dlogp_it = w_it * -A_it s_i where unclipped; GSPO spreads each token's term over the row:
    d/dlogp_it = sum_t' w_it' * -A_it' s_i / |y_i| (t' unclipped). Equal values, different gradients."""
    ro, _ = hand_batch()
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(ro.mask.shape, generator=g, dtype=D) * ro.mask
    kw = {"eps_low": EPS[0], "eps_high": EPS[1]}
    (seq_loss, seq_grad), (tok_loss, tok_grad) = (token_step(build("gspo", variant=v, **kw), ro, adv)
                                                  for v in ("gspo", "gspo_token"))
    w = ro.mask / ro.mask.sum(dim=1, keepdim=True) / ro.mask.shape[0]  # seq-mean-token-mean
    lens = ro.mask.sum(dim=1, keepdim=True)
    s = torch.exp(((ro.logp - ro.old_logp) * ro.mask).sum(dim=1, keepdim=True) / lens)
    lo, hi = 1 - EPS[0], 1 + EPS[1]
    binds = torch.maximum(-adv * s.clamp(lo, hi), -adv * s) > -adv * s  # the clipped branch carries no gradient
    per_tok = torch.where(binds, torch.zeros_like(adv), w * -adv * s) * ro.mask
    assert binds[ro.mask > 0].any() and not binds[ro.mask > 0].all()
    assert torch.allclose(tok_grad, per_tok, rtol=1e-10, atol=1e-15)
    assert torch.allclose(seq_grad, per_tok.sum(dim=1, keepdim=True) / lens * ro.mask, rtol=1e-10, atol=1e-15)
    want = float((w * torch.maximum(-adv * s, -adv * s.clamp(lo, hi)) * ro.mask).sum())
    assert tok_loss == pytest.approx(want, rel=1e-12) and seq_loss == pytest.approx(want, rel=1e-12)
    assert float((tok_grad - seq_grad).abs().max()) > 1e-3


@pytest.mark.parametrize("variant", ["gspo", "gspo_token"])
def test_masked_tokens_have_no_effect(variant):
    """Environment / tool tokens (mask 0) enter neither s_i nor |y_i|: rewriting them changes nothing."""
    ro, adv = hand_batch()
    other = Rollout(*(getattr(ro, f).clone() for f in ro.__dataclass_fields__))
    hole = ro.mask == 0
    for f in ("logp", "old_logp", "rollout_logp"):
        getattr(other, f)[hole] = torch.linspace(-30.0, 30.0, int(hole.sum()), dtype=D)
    kw = {"eps_low": EPS[0], "eps_high": EPS[1], "variant": variant}
    a, b = run_step(build("gspo", **kw), ro, adv=adv), run_step(build("gspo", **kw), other, adv=adv)
    assert a.loss == b.loss and torch.equal(a.grad_logp, b.grad_logp)
    assert a.step_metrics == b.step_metrics and float(a.grad_logp[hole].abs().max()) == 0.0


def _threaded_ranks(ro: Rollout, kw: dict, halves: list[slice]):
    """Each rank a thread with its own rows; the SUM reducer exchanges through a barrier (a gloo all-reduce's
    contract, in one process)."""
    slots: list = [None] * len(halves)
    barrier = threading.Barrier(len(halves))
    out: list = [None] * len(halves)

    def reducer(rank: int):
        def reduce(x: torch.Tensor) -> torch.Tensor:
            slots[rank] = x.clone()
            barrier.wait()
            total = sum(slots)
            barrier.wait()
            return total
        return reduce

    def work(rank: int) -> None:
        out[rank] = run_step(build("gspo", **kw), ro.rows(halves[rank]), splits=2, reduce=reducer(rank))

    threads = [threading.Thread(target=work, args=(r,)) for r in range(len(halves))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return out


@pytest.mark.parametrize("mode", AGG_MODES)
def test_exact_under_micro_batch_and_data_parallel_splits(mode):
    ro = make_rollout(seed=17)
    kw = {"loss_agg_mode": mode, "max_response_len": 16, "eps_low": 0.05, "eps_high": 0.05}
    one = run_step(build("gspo", **kw), ro)
    five = run_step(build("gspo", **kw), ro, splits=5)
    ranks = _threaded_ranks(ro, kw, [slice(0, 8), slice(8, 24)])  # whole prompt groups per rank (groups of 4)
    assert torch.allclose(five.grad_logp, one.grad_logp, rtol=1e-12, atol=1e-15)
    assert torch.allclose(torch.cat([r.grad_logp for r in ranks]), one.grad_logp, rtol=1e-12, atol=1e-15)
    assert sum(r.loss for r in ranks) == pytest.approx(one.loss, rel=1e-12)
    for r in (five, *ranks):
        assert r.step_metrics == pytest.approx(one.step_metrics, rel=1e-12)


def test_inert_rows_leave_without_changing_the_update():
    ro, adv = hand_batch()
    adv[3] = 0.0
    alg = build("gspo", eps_low=EPS[0], eps_high=EPS[1])
    inert = alg.inert_rows(adv, alg.token_weights(ro.mask, ro.group_ids))
    assert inert.tolist() == [False, False, False, True, False, False]
    assert float(run_step(alg, ro, adv=adv).grad_logp[3].abs().max()) == 0.0
    assert build("gspo", kl_coef=0.1).inert_rows(adv, alg.token_weights(ro.mask, ro.group_ids)).sum() == 0


@pytest.mark.parametrize("cfg,match", [
    ({"variant": "token"}, r"variant='token' is not one of \['gspo', 'gspo_token'\]"),
    ({"eps_low": 1.5}, r"need 0 <= eps_low <= 1 and eps_high >= 0"),
    ({"eps_high": -1e-4}, r"need 0 <= eps_low <= 1 and eps_high >= 0"),
])
def test_bad_configs_name_the_key(cfg, match):
    with pytest.raises(ValueError, match=match):
        build("gspo", **cfg)


def test_cli_overrides_build_gspo_token():
    """The override strings `mcore-rl-train algorithm=gspo ...` takes reach the built algorithm."""
    from mcore_rl.algorithms import build_algorithm
    from tests.config.keyscan import compose

    cfg = compose(["algorithm=gspo", "algorithm.variant=gspo_token", "algorithm.eps_low=0.001",
                   "algorithm.eps_high=0.002", "schedule=async"])
    alg = build_algorithm(cfg.algorithm)
    assert (alg.name, alg.config.variant, alg.config.eps_low, alg.config.eps_high) == ("gspo", "gspo_token", 1e-3, 2e-3)
    assert alg.config.schedule == "async" and alg.config.max_staleness >= 1
