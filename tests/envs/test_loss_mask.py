"""The loss respects the multi-turn mask: tool / environment tokens between model turns change nothing.

A multi-turn row is a single-turn row with blocks of non-policy tokens (mask 0) inserted between its turns. For
every algorithm and every loss aggregation: (1) the loss and the gradients on policy tokens equal those of the
same tokens packed together with the holes removed (the policy tokens alone), (2) the gradient on every hole is
exactly 0, (3) rewriting what the holes hold (other tool text: other log-probs, entropies, reference values)
changes neither loss nor any gradient. The aggregation weights match the hand formulas with denominators that
count policy tokens only, and GRPO's loss matches a hand computation over policy tokens.
"""

from __future__ import annotations

import pytest
import torch

from mcore_rl.algorithms import config_class, registered_algorithms
from mcore_rl.algorithms.aggregation import AGG_MODES, aggregation_weights
from tests.algorithms.algo_testlib import Rollout, build, make_rollout, run_step

L_MAX = 16
FIELDS = ("logp", "rollout_logp", "old_logp", "prox_logp", "ref_logp", "entropy")


def with_holes(ro: Rollout, seed: int, fill: float) -> tuple[Rollout, torch.Tensor]:
    """Insert 1-3 env tokens (mask 0, values `fill` + noise) after the 1st..3rd policy token of each row, as tool
    output between turns. Returns the new rollout and `where` [N, T'] -> column of the packed row (-1 = hole)."""
    g = torch.Generator().manual_seed(seed)
    n, t = ro.mask.shape
    lens = ro.mask.sum(dim=1).long()
    layouts = []
    for i in range(n):
        cols: list[int] = []
        cuts = sorted({int(c) for c in torch.randint(1, max(2, int(lens[i])), (2,), generator=g)})
        for j in range(t):
            if j in cuts:
                cols += [-1] * int(torch.randint(1, 4, (1,), generator=g))
            cols.append(j)
        layouts.append(cols)
    width = max(map(len, layouts))
    where = torch.full((n, width), -1, dtype=torch.long)
    for i, cols in enumerate(layouts):
        where[i, : len(cols)] = torch.tensor(cols)
    out = {}
    for f in ("mask", *FIELDS):
        src = getattr(ro, "logp" if f == "logp" else f)
        dst = (
            fill + 0.5 * torch.rand(n, width, generator=g, dtype=src.dtype)
            if f != "mask"
            else torch.zeros(n, width, dtype=src.dtype)
        )
        keep = where >= 0
        dst[keep] = src.gather(1, where.clamp(min=0))[keep]
        out[f] = dst
    holed = Rollout(
        ro.rewards,
        ro.group_ids,
        out["mask"],
        out["logp"],
        out["rollout_logp"],
        out["old_logp"],
        out["prox_logp"],
        out["ref_logp"],
        out["entropy"],
    )
    return holed, where


def _config(name: str, mode: str) -> dict:
    cfg = {"loss_agg_mode": mode, "max_response_len": L_MAX, "kl_coef": 0.01, "entropy_coef": 0.01}
    if config_class(name)().overlong_buffer_len > 0:  # DAPO: its penalty reads the policy-token length
        cfg["overlong_buffer_len"] = 4
    return cfg


def _run(name: str, mode: str, ro: Rollout):
    """The trainer's whole step: advantages (lengths = policy tokens per row), weights, micro-batches, backward."""
    return run_step(build(name, **_config(name, mode)), ro, splits=2)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", registered_algorithms())
def test_holes_change_no_loss_and_no_gradient(name, mode):
    packed = make_rollout(groups=4, group_size=4, t=L_MAX, seed=3)
    holed, where = with_holes(packed, seed=5, fill=-2.0)
    other, _ = with_holes(packed, seed=5, fill=-9.0)  # same layout, other text in the holes
    assert torch.equal(holed.mask, other.mask) and not torch.equal(holed.logp, other.logp)
    a, b, c = _run(name, mode, packed), _run(name, mode, holed), _run(name, mode, other)
    assert abs(a.loss) > 1e-6
    assert b.loss == pytest.approx(a.loss, rel=1e-9, abs=1e-12)
    assert c.loss == b.loss
    holes = where < 0
    assert holes.sum() >= packed.mask.shape[0]  # every row has at least one env block
    assert float(b.grad_logp[holes].abs().max()) == 0.0
    assert float(b.grad_entropy[holes].abs().max()) == 0.0
    assert torch.equal(b.grad_logp, c.grad_logp) and torch.equal(b.grad_entropy, c.grad_entropy)
    keep = ~holes
    back = torch.zeros_like(a.grad_logp)
    back_ent = torch.zeros_like(a.grad_entropy)
    back.scatter_add_(1, where.clamp(min=0), torch.where(keep, b.grad_logp, torch.zeros_like(b.grad_logp)))
    back_ent.scatter_add_(
        1, where.clamp(min=0), torch.where(keep, b.grad_entropy, torch.zeros_like(b.grad_entropy))
    )
    assert torch.allclose(back, a.grad_logp, rtol=1e-9, atol=1e-12)
    assert torch.allclose(back_ent, a.grad_entropy, rtol=1e-9, atol=1e-12)
    assert float(a.grad_logp.abs().sum()) > 0


def _hand_weights(mask: torch.Tensor, groups: torch.Tensor, mode: str) -> torch.Tensor:
    """The four aggregations written out with policy-token counts (holes count nowhere)."""
    lens = mask.sum(dim=1)
    n_seq = int((lens > 0).sum())
    w = torch.zeros_like(mask)
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[i, t] == 0:
                continue
            if mode == "token-mean":
                w[i, t] = 1.0 / mask.sum()
            elif mode == "seq-mean-token-mean":
                w[i, t] = 1.0 / lens[i] / n_seq
            elif mode == "prompt-mean":
                same = groups == groups[i]
                n_prompts = len({int(g) for g, ln in zip(groups, lens) if ln > 0})
                w[i, t] = 1.0 / lens[same].sum() / n_prompts
            else:
                w[i, t] = 1.0 / (L_MAX * n_seq)
    return w


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation_denominators_count_policy_tokens_only(mode):
    holed, _ = with_holes(make_rollout(groups=3, group_size=4, t=L_MAX, seed=7), seed=2, fill=0.0)
    got = aggregation_weights(holed.mask, holed.group_ids, mode, max_len=L_MAX)
    want = _hand_weights(holed.mask, holed.group_ids, mode)
    assert torch.allclose(got.double(), want.double(), rtol=1e-12, atol=0)
    assert float(got[holed.mask == 0].abs().max()) == 0.0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_grpo_loss_equals_hand_computation_over_policy_tokens(mode):
    holed, _ = with_holes(make_rollout(groups=3, group_size=4, t=L_MAX, seed=11), seed=4, fill=-3.0)
    adv = torch.linspace(-1.0, 1.0, holed.mask.shape[0], dtype=holed.mask.dtype)
    alg = build("grpo", loss_agg_mode=mode, max_response_len=L_MAX, kl_coef=0.0, eps_low=0.2, eps_high=0.2)
    got = run_step(alg, holed, splits=3, adv=adv).loss
    w = _hand_weights(holed.mask, holed.group_ids, mode)
    total = 0.0
    for i, t in holed.mask.nonzero().tolist():
        r = float(torch.exp(holed.logp[i, t] - holed.old_logp[i, t]))
        a = float(adv[i])
        total += float(w[i, t]) * max(-a * r, -a * min(max(r, 0.8), 1.2))
    assert got == pytest.approx(total, rel=1e-10)
