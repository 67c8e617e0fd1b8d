"""Shared helpers for the algorithm tests: a random rollout batch and a loss/gradient driver."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mcore_rl.algorithms import Algorithm, TokenBatch, build_algorithm, identity_reduce
from mcore_rl.algorithms.reduce import Reducer


@dataclass
class Rollout:
    rewards: Tensor       # [N]
    group_ids: Tensor     # [N]
    mask: Tensor          # [N, T]
    logp: Tensor          # [N, T] current policy (a plain tensor; a leaf is made per run)
    rollout_logp: Tensor
    old_logp: Tensor
    prox_logp: Tensor
    ref_logp: Tensor
    entropy: Tensor

    def rows(self, idx: slice | Tensor) -> Rollout:
        return Rollout(*(getattr(self, f)[idx] for f in self.__dataclass_fields__))


def make_rollout(groups: int = 6, group_size: int = 4, t: int = 12, seed: int = 0, veto_tokens: int = 6,
                 dtype: torch.dtype = torch.float64) -> Rollout:
    """Random batch with variable lengths, a zero-variance group, ratios that clip and a few NAV triggers."""
    g = torch.Generator().manual_seed(seed)
    n = groups * group_size
    group_ids = torch.arange(groups).repeat_interleave(group_size) * 7 + 3       # non-contiguous ids
    rewards = torch.randint(0, 2, (n,), generator=g).to(dtype)
    rewards[:group_size] = 1.0                                                    # one all-equal group
    rewards[group_size:2 * group_size] = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=dtype)[:group_size]
    lens = torch.randint(2, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None, :] < lens[:, None]).to(dtype)
    logp = -torch.rand(n, t, generator=g, dtype=dtype) * 3 - 0.05
    rollout = logp + 0.35 * torch.randn(n, t, generator=g, dtype=dtype)
    old = rollout + 0.05 * torch.randn(n, t, generator=g, dtype=dtype)
    prox = logp + 0.1 * torch.randn(n, t, generator=g, dtype=dtype)
    ref = logp + 0.2 * torch.randn(n, t, generator=g, dtype=dtype)
    ent = torch.rand(n, t, generator=g, dtype=dtype) * 2
    # a few tokens whose ratio against the behaviour log-probs is < 1e-4 (NAV triggers on A < 0 rows)
    rows = torch.nonzero(rewards == 0).flatten()[:veto_tokens]
    for k, r in enumerate(rows.tolist()):
        pos = min(int(lens[r]) - 1, k % 3)
        rollout[r, pos] = logp[r, pos] + 12.0
        old[r, pos] = rollout[r, pos]
    # a few positive-advantage tokens with a large ratio (CISPO truncation, PPO clipping)
    for r in torch.nonzero(rewards == 1).flatten()[:veto_tokens].tolist():
        rollout[r, 0] = logp[r, 0] - 2.5
        old[r, 0] = rollout[r, 0]
    # padding holds finite junk, as a trainer would leave it
    for x in (logp, rollout, old, prox, ref):
        x[mask == 0] = -1.0
    return Rollout(rewards, group_ids, mask, logp, rollout, old, prox, ref, ent)


def token_batch(ro: Rollout, adv_tok: Tensor, weights: Tensor, logp: Tensor, entropy: Tensor) -> TokenBatch:
    return TokenBatch(logp=logp, mask=ro.mask, advantages=adv_tok, rollout_logp=ro.rollout_logp,
                      token_weight=weights, old_logp=ro.old_logp, prox_logp=ro.prox_logp, ref_logp=ro.ref_logp,
                      entropy=entropy)


@dataclass
class RunResult:
    loss: float            # summed micro-batch losses, times grad_scale
    grad_logp: Tensor      # dL/dlogp [N, T] after grad_scale
    grad_entropy: Tensor
    metrics: list[dict[str, float]]
    step_metrics: dict[str, float]


def run_step(alg: Algorithm, ro: Rollout, splits: int = 1, reduce: Reducer = identity_reduce,
             adv: Tensor | None = None) -> RunResult:
    """advantages -> token_weights -> per-micro-batch loss/backward -> finish_accumulation, as a trainer does."""
    if adv is None:
        res = alg.advantages(ro.rewards, ro.group_ids, reduce, lengths=ro.mask.sum(dim=1))
        adv = res.advantages.to(ro.mask.dtype)
        keep = res.keep
    else:
        keep = None
    weights = alg.token_weights(ro.mask, ro.group_ids, reduce, keep=keep)
    adv_tok = adv[:, None].expand_as(ro.mask).contiguous()
    logp = ro.logp.clone().requires_grad_(True)
    ent = ro.entropy.clone().requires_grad_(True)
    n = ro.mask.shape[0]
    bounds = [round(i * n / splits) for i in range(splits + 1)]
    total, metrics = 0.0, []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        sub = ro.rows(slice(lo, hi))
        mb = token_batch(sub, adv_tok[lo:hi], weights[lo:hi], logp[lo:hi], ent[lo:hi])
        loss, m = alg.loss(mb, reduce)
        loss.backward()
        total += float(loss.detach())
        metrics.append(m)
    acc = alg.finish_accumulation(reduce)
    g_ent = ent.grad if ent.grad is not None else torch.zeros_like(ent)
    return RunResult(total * acc.grad_scale, logp.grad * acc.grad_scale, g_ent * acc.grad_scale, metrics,
                     acc.metrics)


def build(name: str, **overrides) -> Algorithm:
    return build_algorithm({"name": name, **overrides})


def finite_close(a: Tensor, b: Tensor, tol: float = 1e-6) -> bool:
    return bool(torch.isfinite(a).all()) and float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max()))


LOG_1E4 = math.log(1e-4)
