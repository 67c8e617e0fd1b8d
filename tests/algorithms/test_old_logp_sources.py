"""Old-log-prob sources on a real (single-rank) Megatron policy: per-token-version scoring is exact on rows that
span versions, the store frees and restores bit for bit, old_logit_model scores samples at their own version,
and the registry matches the algorithm config's choices."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.batch import build_rollout_batch
from mcore_rl.oldlogp import SOURCES, SourceContext, build_source
from mcore_rl.oldlogp.interrupt import check_single_version
from mcore_rl.oldlogp.store import MissingVersionError, VersionStore, score_by_version
from mcore_rl.rollout.protocol import Sample
from mcore_rl.utils import params_restored

pytestmark = pytest.mark.algorithms
T = 0.7


@pytest.fixture(scope="module")
def policy(tiny_llama_dir):
    from mcore_rl.distributed import init_distributed
    from mcore_rl.policy.policy import Policy, PolicyConfig

    init_distributed(1, 1)
    pol = Policy(tiny_llama_dir, PolicyConfig(token_budget=128), trainable=False)
    pol.load_hf(tiny_llama_dir)
    return pol


def _perturb(policy, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def _samples(versions_per_row: list[list[int]]) -> list[Sample]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i, vs in enumerate(versions_per_row):
        n_prompt = 4 + i
        prompt = torch.randint(1, 512, (n_prompt,), generator=g).tolist()
        toks = torch.randint(1, 512, (len(vs),), generator=g).tolist()
        out.append(Sample(f"r-{i}", prompt, toks, [0.0] * len(vs), list(vs), "length", sample_index=0))
    return out


def _rb(samples):
    n = len(samples)
    return build_rollout_batch(samples, [0.0] * n, [False] * n, list(range(n)))


def test_registry_matches_config_choices():
    with pytest.raises(ValueError, match="old_logp_source='nope'"):
        build_source("nope", SourceContext(policy=None, temperature=1.0, staleness=0))
    exact = {name for name, cls in SOURCES.load_all().items() if cls.exact}
    assert exact == {"snapshot", "old_logit_model", "interrupt"}  # every built-in module registers its name


def test_per_token_version_scoring_is_exact_on_spanning_rows(policy):
    """Three versions; rows span 2-3 of them. Each token must equal the full forward under its own version."""
    params = list(policy.model.parameters())
    store = VersionStore()
    full = {}
    rb = _rb(_samples([[0] * 6 + [1] * 5 + [2] * 4, [1] * 10, [0] * 3 + [2] * 9, [2] * 7]))
    with params_restored(params):  # the module's policy is shared: leave its weights as found
        for v in range(3):
            if v:
                _perturb(policy, v)
            store.put(v, params)
            full[v] = policy.logprobs(rb.policy_batch(), T)
        assert store.versions == [0, 1, 2] and store.nbytes == 3 * sum(p.numel() * 4 for p in params)
        got = score_by_version(policy, store, rb, current_version=2, temperature=T)
        m = rb.loss_mask > 0
        want = torch.zeros_like(got)
        for v in range(3):
            want[rb.versions == v] = full[v][rb.versions == v]
        assert (got - want)[m].abs().max().item() == 0.0
        stale = m & (rb.versions < 2)
        assert (full[2] - want)[stale].abs().max().item() > 1e-3  # recompute (current weights) is wrong there
        assert all(torch.equal(p, q) for p, q in zip(params, store._weights[2]))  # live weights restored
        store.free_below(2)
        assert store.versions == [2]
        with pytest.raises(MissingVersionError, match="version 0 is not stored"):
            score_by_version(policy, store, rb, current_version=2, temperature=T)


def test_snapshot_source_frees_what_no_round_can_reference(policy):
    src = build_source("snapshot", SourceContext(policy=policy, temperature=T, staleness=2))
    for v in range(4):
        src.on_version(v)
    rb = _rb(_samples([[1, 1, 2, 3], [3, 3]]))
    src.old_logp(rb, version=3)  # consumed at 3 with k=2: the next round (at 4) needs versions >= 2
    assert src.store.versions == [2, 3]
    m = src.metrics()
    assert m["old_logp_snapshots"] == 2.0 and m["old_logp_snapshot_gb"] > 0


def test_old_logit_model_scores_finished_samples_at_their_version(policy, tiny_llama_dir):
    """Finished version-0 samples are scored at the hook for version 1 (model still holding 0); after that the
    model holds 1 and unscored version-1 samples are scored when consumed. Both equal a forward at the version."""
    params = list(policy.model.parameters())
    src = build_source("old_logit_model", SourceContext(
        policy=policy, temperature=T, staleness=2,
        make_policy=lambda: type(policy)(tiny_llama_dir, policy.cfg, trainable=False)))
    early, late = _samples([[0] * 5, [0] * 8]), _samples([[1] * 6, [1] * 3, [1] * 4])[1:]
    for s in late:
        s.rid = "late-" + s.rid
    with params_restored(params):  # the module's policy is shared: leave its weights as found
        src.on_version(0)
        v0 = policy.logprobs(_rb(early).policy_batch(), T)
        _perturb(policy, 7)  # the optimizer moved the trainer to version 1
        src.on_version(1, finished=lambda: early + late)  # late carries version 1: deferred
        assert src.scored_early == 2
        batch = _rb(early + late)
        got = src.old_logp(batch, version=1)
        v1 = policy.logprobs(batch.policy_batch(), T)
        m = batch.loss_mask > 0
        want = v1.clone()
        want[:2, :v0.shape[1]] = v0
        assert (got - want)[m].abs().max().item() <= 1e-6
        assert (got - v1)[:2][m[:2]].abs().max().item() > 1e-3
        assert src.metrics()["old_logp_cached"] == 0.0


def test_single_version_check_names_spanning_rows():
    with pytest.raises(RuntimeError, match=r"rows \[1\] have a turn that spans several weight versions"):
        check_single_version(_rb(_samples([[0, 0], [0, 1]])))


def test_interrupt_needs_an_engine_that_can_restart_samples():
    class NoInterruptEngine:  # e.g. the SGLang remote engine: no set_interrupt_on_update
        pass

    for name in ("interrupt", "old_logit_model"):
        with pytest.raises(ValueError, match=f"old_logp_source={name}: rollout engine NoInterruptEngine cannot"):
            build_source(name, SourceContext(policy=None, temperature=1.0, staleness=1, engine=NoInterruptEngine(),
                                             make_policy=lambda: None))
