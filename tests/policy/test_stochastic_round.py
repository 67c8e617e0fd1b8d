"""bf16 stochastic rounding of the master -> model weight copy (mcore_rl/policy/stochastic_round.py).

What must hold: each rounded value is one of its two bf16 neighbours and their average over draws is the fp32 value
(unbiased); in a real bf16 Megatron policy the model weights then follow the masters' update in expectation (the
round-to-nearest copy leaves most of a small update behind: the dead zone), the masters themselves stay exactly what
a round-to-nearest run computes, and the noise is a function of (seed, step) only.
"""

from __future__ import annotations

import pytest
import torch

from mcore_rl.policy.stochastic_round import stochastic_round_to_bf16_
from tests.train_step import train_step

pytestmark = pytest.mark.multiproc  # the policy tests build real Megatron modules (one gloo rank)


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and above |x| (toward and away from zero), as fp32."""
    bits = x.view(torch.int32)
    down = (bits & -(1 << 16)).view(torch.float32)
    up = ((bits & -(1 << 16)) + (1 << 16)).view(torch.float32)
    exact = (bits & 0xFFFF) == 0
    return down, torch.where(exact, down, up)


def test_rounding_lands_on_a_neighbour_and_is_unbiased():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * torch.logspace(-6, 2, 4096)
    x[:3] = torch.tensor([float("inf"), float("-inf"), 1.0])  # inf stays inf, an exact bf16 value stays put
    down, up = _neighbours(x.clone())
    gen = torch.Generator().manual_seed(1)
    draws = torch.stack([stochastic_round_to_bf16_(x.clone(), gen) for _ in range(400)])
    assert torch.equal(draws.bfloat16().float(), draws)  # every draw exactly representable in bf16
    assert bool(((draws == down) | (draws == up)).all())
    assert draws[:, 0].isinf().all() and (draws[:, 1] == float("-inf")).all() and (draws[:, 2] == 1.0).all()
    # unbiased: the mean over 400 draws sits within 5 standard errors of x, per element, in units of the gap
    fin = slice(3, None)
    gap = (up - down)[fin].abs().clamp_min(1e-45)
    p = ((x[fin] - down[fin]) / (up[fin] - down[fin]).where(up[fin] != down[fin], torch.ones(1))).clamp(0, 1)
    se = (p * (1 - p) / 400).sqrt().clamp_min(1e-3)
    z = ((draws[:, fin].mean(0) - x[fin]) / gap).abs() / se
    assert z.max().item() < 5.5, z.max().item()
    # round-to-nearest would be biased by up to half a gap; here the average error over elements is ~0
    assert ((draws[:, fin].mean(0) - x[fin]) / gap).mean().abs().item() < 0.01


def _policy(folder, sr: bool, seed: int = 0, lr: float = 1e-5):
    from mcore_rl.config.optim import OptimSettings
    from mcore_rl.models.spec import BuildConfig
    from mcore_rl.policy.policy import Policy, PolicyConfig

    cfg = PolicyConfig(build=BuildConfig(dtype="bf16"), token_budget=256, seed=seed,
                       optim=OptimSettings(lr=lr, bf16_stochastic_rounding=sr))
    pol = Policy(folder, cfg)
    pol.load_hf(folder)
    return pol


def _step(pol) -> None:
    from mcore_rl.policy.step import PolicyBatch

    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    _, m = train_step(pol, PolicyBatch(tokens, torch.ones(2, 16)),
                          lambda mb, logp, ent: (-(logp * mb.loss_mask).sum() / 32, {}))
    assert m["update_ok"] == 1.0


def _flat(pol) -> tuple[torch.Tensor, torch.Tensor]:
    opts = getattr(pol.optimizer, "chained_optimizers", [pol.optimizer])
    model = torch.cat([p.detach().float().flatten() for o in opts for g in o.float16_groups for p in g])
    master = torch.cat([p.detach().flatten() for o in opts for g in o.fp32_from_float16_groups for p in g])
    return model, master


def test_bf16_policy_weights_follow_the_masters_without_a_dead_zone(tiny_llama_dir):
    from mcore_rl.distributed import init_distributed

    init_distributed(1, 1)
    rtn, sr = _policy(tiny_llama_dir, sr=False), _policy(tiny_llama_dir, sr=True)
    model0, master0 = _flat(rtn)
    assert torch.equal(model0, master0)  # masters start ON the bf16 grid: the source of the dead zone
    _step(rtn)
    _step(sr)
    (m_rtn, w_rtn), (m_sr, w_sr) = _flat(rtn), _flat(sr)
    assert torch.equal(w_rtn, w_sr)  # same grads from the same bf16 weights; the masters are restored exactly
    d = w_sr - master0
    # projection of the model's move on the master's move: 1 = the weights moved as the optimizer did
    follow = {name: float((m - model0) @ d / (d @ d)) for name, m in (("rtn", m_rtn), ("sr", m_sr))}
    changed = {name: float((m != model0).float().mean()) for name, m in (("rtn", m_rtn), ("sr", m_sr))}
    print(f"lr 1e-5, one Adam step: follow {follow}, fraction of bf16 weights changed {changed}")
    assert follow["rtn"] < 0.2 and changed["rtn"] < 0.1  # round-to-nearest: most of the update is lost
    assert 0.9 < follow["sr"] < 1.1 and changed["sr"] > 1.5 * changed["rtn"]  # stochastic: kept in expectation


def test_noise_is_a_function_of_seed_and_step(tiny_llama_dir):
    from mcore_rl.distributed import init_distributed

    init_distributed(1, 1)
    a, b, c = (_policy(tiny_llama_dir, sr=True, seed=s) for s in (7, 7, 8))
    for pol in (a, b, c):
        _step(pol)
    assert torch.equal(_flat(a)[0], _flat(b)[0])
    assert not torch.equal(_flat(a)[0], _flat(c)[0])
    # the step number enters the seed: a scheduler that says "step 5" draws step 5's noise, as a resumed run would
    b.scheduler.num_steps = a.scheduler.num_steps = 5
    _step(a)
    _step(b)
    assert torch.equal(_flat(a)[0], _flat(b)[0])
