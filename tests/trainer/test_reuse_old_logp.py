"""`trainer.reuse_old_logp`: with old_logp_source=recompute and one update per round, the anchor is the update's own
forward (detached) instead of a separate scoring forward, and the update is the same.

A real Megatron policy (tiny Llama, one gloo rank, several micro-batches) takes the same GRPO update twice from the
same weights and optimizer state: once against a recompute anchor from `Policy.logprobs`, once with the anchor
taken inside the loss. Loss, gradient norm, clip fraction, the train-inference mismatch and the post-step
log-probs agree. Then the decision table (which sources / schedules / algorithms may reuse), and the CLI: two runs
of GRPO on the tiny task with and without reuse train alike while the reusing one runs no scoring forward."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from mcore_rl.algorithms import build_algorithm
from mcore_rl.oldlogp import SourceContext, build_source
from mcore_rl.trainer.learner import reuses_old_logp
from mcore_rl.trainer.update import run_update
from tests.policy.conftest import loaded_policy, restored
from tests.trainer.test_skip_inert_rows import _batch

pytestmark = pytest.mark.multiproc  # builds real Megatron modules (one gloo rank)


@pytest.fixture(scope="module")
def policy(tiny_llama_dir):
    return loaded_policy(tiny_llama_dir, token_budget=48)  # several micro-batches


def _update(policy, alg, rb, reuse: bool) -> tuple[dict, torch.Tensor]:
    adv = alg.advantages(rb.rewards, rb.group_ids, lengths=rb.response_len)
    anchors = {} if reuse else {"old_logp": policy.logprobs(rb.policy_batch())}
    metrics = run_update(policy, alg, rb, adv.advantages, adv.keep, anchors, 1.0, old_logp_from_forward=reuse)
    return metrics, policy.logprobs(rb.policy_batch())


@pytest.mark.parametrize("over", [
    {"kl_coef": 0.0},                                           # the main job's GRPO loss (no reference policy)
    {"kl_coef": 0.0, "correction": {"mode": "tis", "ratio": "old"}},  # a correction that reads pi_old / pi_roll
])  # fmt: skip
def test_the_update_is_the_same_with_the_anchor_from_its_own_forward(policy, over):
    rb = _batch()
    alg = build_algorithm({"name": "grpo", "old_logp_source": "recompute", **over})
    logp0 = policy.logprobs(rb.policy_batch())
    with restored(policy):
        sep, logp_sep = _update(policy, alg, rb, reuse=False)
    with restored(policy):
        own, logp_own = _update(policy, alg, rb, reuse=True)

    assert sep["grad_norm"] > 1e-3  # a real step: the comparison has teeth
    assert abs(own["grad_norm"] - sep["grad_norm"]) <= 1e-5 * sep["grad_norm"], (own, sep)
    assert abs(own["loss"] - sep["loss"]) <= 1e-6 + 1e-5 * abs(sep["loss"])
    for k in ("pg_clipfrac", "train_rollout_logprob_abs_diff"):
        assert abs(own[k] - sep[k]) <= 1e-6, (k, own[k], sep[k])
    assert sep["train_rollout_logprob_abs_diff"] > 0.1  # the engine anchor is random: the metric reads old_logp
    m = rb.loss_mask > 0
    moved = (logp_sep - logp0)[m].abs().max().item()
    assert moved > 1e-3
    assert (logp_own - logp_sep)[m].abs().max().item() <= 1e-3 * moved


def test_an_algorithm_with_whole_batch_statistics_refuses(policy):
    """P3O's batch ESS reads old_logp before the first micro-batch: nothing to take it from there."""
    rb = _batch()
    alg = build_algorithm({"name": "p3o", "old_logp_source": "recompute", "ess_scope": "batch"})
    adv = alg.advantages(rb.rewards, rb.group_ids, lengths=rb.response_len)
    with pytest.raises(ValueError, match="reuse_old_logp"):
        run_update(policy, alg, rb, adv.advantages, adv.keep, {}, 1.0, old_logp_from_forward=True)


def _policy_stub(lora_dropout: float = 0.0):
    return SimpleNamespace(cfg=SimpleNamespace(lora=SimpleNamespace(dropout=lora_dropout)))


@pytest.mark.parametrize("source,alg,mu,audit,dropout,enabled,expect", [
    ("recompute", {}, 1, 0.0, 0.0, True, True),
    ("recompute", {}, 1, 0.0, 0.0, False, False),      # trainer.reuse_old_logp=false
    ("recompute", {}, 4, 0.0, 0.0, True, False),       # the second update's weights have moved
    ("recompute", {}, 1, 0.5, 0.0, True, False),       # the audit measures the scoring pass itself
    ("recompute", {}, 1, 0.0, 0.1, True, False),       # LoRA dropout: the training forward differs
    ("snapshot", {}, 1, 0.0, 0.0, True, False),        # stored versions, not the live weights
    ("rollout", {}, 1, 0.0, 0.0, True, False),         # no trainer-side anchor at all
    ("recompute", {"name": "p3o", "ess_scope": "batch"}, 1, 0.0, 0.0, True, False),
    ("recompute", {"name": "p3o", "ess_scope": "microbatch"}, 1, 0.0, 0.0, True, True),
])  # fmt: skip
def test_which_runs_reuse(source, alg, mu, audit, dropout, enabled, expect):
    algorithm = build_algorithm({"name": "grpo", **alg, "old_logp_source": source})
    src = build_source(source, SourceContext(policy=None, temperature=1.0, staleness=0, audit_frac=audit))
    assert reuses_old_logp(enabled, src, algorithm, mu, _policy_stub(dropout)) is expect


def test_cli_runs_with_and_without_reuse_train_alike(tmp_path):
    """GRPO with the recompute anchor (no KL) on the tiny task, 2 updates, through the CLI with the default
    `trainer.reuse_old_logp=true` and with `false`: update 1 (same weights, same rollouts) has the same loss and
    gradient norm; the reusing run spends no time and no FLOPs scoring, the other one does."""
    from tests.conftest import run_train_batch
    from tests.e2e.sevens import TINY_TASK

    base = [*TINY_TASK, "seed=3", "trainer.steps=2", "trainer.prompts_per_update=8", "trainer.samples_per_prompt=4",
            "trainer.max_new_tokens=8", "trainer.deterministic=true", "trainer.export_hf=false", "eval.num_prompts=2",
            "eval.samples_per_prompt=1", "eval.max_new_tokens=2", "algorithm=grpo", "algorithm.kl_coef=0.0",
            "algorithm.old_logp_source=recompute", "algorithm.updates_per_rollout=1", "logging.progress=false",
            "logging.plot=false", "logging.tensorboard=false", "optim.lr=1e-3"]  # fmt: skip
    runs = {"reuse": [*base, f"run.dir={tmp_path / 'reuse'}"],
            "score": [*base, "trainer.reuse_old_logp=false", f"run.dir={tmp_path / 'score'}"]}  # fmt: skip
    results = run_train_batch(list(runs.values()), tmp_path)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    recs = {k: [json.loads(x) for x in (tmp_path / k / "metrics.jsonl").read_text().splitlines()] for k in runs}
    r, s = recs["reuse"][0], recs["score"][0]
    assert r["reward_mean"] == s["reward_mean"] and 0 < r["adv_zero_variance_group_frac"] < 1  # same rollouts
    assert s["grad_norm"] > 0
    assert abs(r["grad_norm"] - s["grad_norm"]) <= 1e-5 * s["grad_norm"], (r["grad_norm"], s["grad_norm"])
    assert abs(r["loss"] - s["loss"]) <= 1e-6 + 1e-5 * abs(s["loss"])
    scored = {k: sum(x.get("time_old_logp", 0.0) for x in recs[k]) for k in runs}
    assert scored["score"] > 0 and scored["reuse"] < 0.05 * scored["score"], scored
    flops = {k: [json.loads(x) for x in (tmp_path / k / "eval.jsonl").read_text().splitlines()][-1]["flops_score"]
             for k in runs}  # fmt: skip
    assert flops["score"] > 0 and flops["reuse"] == 0, flops
