"""`trainer.skip_inert_rows`: rows with an exactly zero gradient leave the forward/backward, and the update is the
same. A real Megatron policy (tiny Llama, one gloo rank) takes the same update twice from the same weights and
optimizer state, once on every row and once on the live rows only: gradient norm, loss and post-step log-probs
agree, while the skipped run trains on a fraction of the rows. The algorithms and configs that cannot promise a
zero gradient (KL or entropy terms, deferred renormalisation, batch statistics, PPO-EWMA's gate) skip nothing."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.algorithms import build_algorithm
from mcore_rl.batch import RolloutBatch
from mcore_rl.trainer.update import live_rows, run_update
from tests.policy.conftest import loaded_policy, restored

pytestmark = pytest.mark.multiproc  # builds real Megatron modules (one gloo rank)

# 6 groups of 4: rewards vary in groups 0 and 3 only, so 16 of 24 rows have advantage exactly 0
REWARDS = [1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0]


def _batch(seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    n, prompt = len(REWARDS), 6
    lens = torch.randint(3, 11, (n,), generator=g)
    L = prompt + int(lens.max())
    tokens = torch.randint(1, 512, (n, L), generator=g)
    mask = torch.zeros(n, L)
    for i, k in enumerate(lens.tolist()):
        mask[i, prompt : prompt + k] = 1
        tokens[i, prompt + k :] = 0
    logp = -torch.rand(n, L, generator=g) * mask  # engine log-probs: the ratio anchor (old_logp_source=rollout)
    r = torch.tensor(REWARDS, dtype=torch.float32)
    return RolloutBatch(tokens=tokens, loss_mask=mask, rollout_logp=logp, versions=torch.zeros(n, L, dtype=torch.long),
                        group_ids=torch.arange(n) // 4, rewards=r, correct=r, response_len=lens,
                        truncated=torch.zeros(n))  # fmt: skip


def _algo(name: str, **over):
    return build_algorithm({"name": name, "old_logp_source": "rollout", **over})


@pytest.fixture(scope="module")
def policy(tiny_llama_dir):
    return loaded_policy(tiny_llama_dir, token_budget=48)  # several micro-batches


def _update(policy, alg, rb, skip: bool) -> tuple[dict, torch.Tensor]:
    adv = alg.advantages(rb.rewards, rb.group_ids, lengths=rb.response_len)
    metrics = run_update(policy, alg, rb, adv.advantages, adv.keep, {}, 1.0, skip_inert_rows=skip)
    return metrics, policy.logprobs(rb.policy_batch())


@pytest.mark.parametrize("name,over", [
    ("grpo", {"kl_coef": 0.0}),                                 # advantage-0 rows
    ("dapo", {"dynamic_sampling": False}),                      # zero-variance filtering: zero-weight rows
    ("cispo", {}),
])  # fmt: skip
def test_skipping_inert_rows_gives_the_same_update(policy, name, over):
    rb = _batch()
    alg = _algo(name, **over)
    logp0 = policy.logprobs(rb.policy_batch())
    with restored(policy):
        full, logp_full = _update(policy, alg, rb, skip=False)
    with restored(policy):
        skipped, logp_skip = _update(policy, alg, rb, skip=True)

    assert full["trained_rows_frac"] == 1.0
    assert skipped["trained_rows_frac"] == pytest.approx(8 / 24)  # groups 0 and 3 only
    assert full["grad_norm"] > 1e-3  # a real step: the comparison has teeth
    assert abs(skipped["grad_norm"] - full["grad_norm"]) <= 1e-5 * full["grad_norm"], (skipped, full)
    assert abs(skipped["loss"] - full["loss"]) <= 1e-6 + 1e-5 * abs(full["loss"])
    m = rb.loss_mask > 0
    moved = (logp_full - logp0)[m].abs().max().item()
    assert moved > 1e-3  # the step moved the policy ...
    assert (logp_skip - logp_full)[m].abs().max().item() <= 1e-3 * moved  # ... and both runs moved it alike


def test_an_update_of_only_inert_rows_still_runs_one_row(policy):
    """Every row inert (all groups solved): one row is kept so the step's collectives still run; gradient 0."""
    rb = _batch()
    rb.rewards = torch.ones(len(rb))
    alg = _algo("grpo", kl_coef=0.0)
    adv = alg.advantages(rb.rewards, rb.group_ids, lengths=rb.response_len)
    w = alg.token_weights(rb.loss_mask, rb.group_ids, keep=adv.keep)
    assert live_rows(alg, adv.advantages, w).tolist() == [0]
    with restored(policy):
        metrics = run_update(policy, alg, rb, adv.advantages, adv.keep, {}, 1.0, skip_inert_rows=True)
    assert metrics["trained_rows_frac"] == pytest.approx(1 / 24)
    assert metrics["grad_norm"] == 0.0


@pytest.mark.parametrize("name,over,expect", [
    ("grpo", {"kl_coef": 0.0}, 16),
    ("grpo", {"kl_coef": 0.001}, 0),                        # KL pulls every row towards the reference
    ("grpo", {"kl_coef": 0.0, "entropy_coef": 0.01}, 0),    # the entropy bonus has a gradient at A = 0
    ("grpo", {"kl_coef": 0.0, "renorm_dropped": "deferred"}, 0),  # the deferred scale counts those rows
    ("dapo", {"dynamic_sampling": False}, 16),              # filtered: zero weights
    ("dapo", {"dynamic_sampling": False, "renorm_dropped": "microbatch"}, None),
    ("scalerl", {}, 16),
    ("mu_grpo", {}, None),                                  # its veto reads whole-batch ratios
    ("p3o", {}, None),                                      # ESS over the whole batch
    ("ppo_ewma", {}, None),                                 # the Train-Infer gate's keep-rate drives resets
])  # fmt: skip
def test_which_rows_each_algorithm_may_skip(name, over, expect):
    rb = _batch()
    alg = _algo(name, **over)
    adv = alg.advantages(rb.rewards, rb.group_ids, lengths=rb.response_len)
    w = alg.token_weights(rb.loss_mask, rb.group_ids, keep=adv.keep)
    inert = alg.inert_rows(adv.advantages, w)
    assert (None if inert is None else int(inert.sum())) == expect


def test_cli_runs_with_and_without_skipping_train_alike(tmp_path):
    """The main job's algorithm (GRPO, engine anchor, no KL) on the tiny task, 3 updates, through the CLI with the
    default `trainer.skip_inert_rows=true` and with `false`: the first update (same weights, same rollouts, a
    quarter of the groups inert) has the same loss and gradient norm, and in every update the skipping run trained
    exactly the rows of groups whose rewards varied.

    Why only the first update is compared across the runs: their micro-batches differ in shape, so from update 2 on
    their weights differ by rounding, which Adam scales up and which can flip a sampled token, so the rollouts
    themselves may part. With AVX2 kernels (`scripts/as_avx2.sh`) the grad norms were 7.7e-5 apart at update 2 and
    4.8% at update 3, with AVX-512 kernels 1e-7 throughout: a property of the CPU's rounding, not of skipping."""
    import json

    from tests.conftest import run_train_batch
    from tests.e2e.sevens import TINY_TASK

    base = [*TINY_TASK, "seed=3", "trainer.steps=3", "trainer.prompts_per_update=8", "trainer.samples_per_prompt=4",
            "trainer.max_new_tokens=8", "trainer.deterministic=true", "trainer.export_hf=false", "eval.num_prompts=2",
            "eval.samples_per_prompt=1", "eval.max_new_tokens=2",
            "logging.progress=false", "logging.plot=false", "logging.tensorboard=false", "optim.lr=1e-3",
            # Adam moves a parameter whose gradient is rounding noise (~1e-7) by a full +-lr at eps=1e-8: eps=1e-4
            # shrinks such noise-sized steps 1000x, so the runs stay close for longer (see the docstring)
            "optim.adam_eps=1e-4"]  # fmt: skip
    runs = {"skip": [*base, f"run.dir={tmp_path / 'skip'}"],
            "full": [*base, "trainer.skip_inert_rows=false", f"run.dir={tmp_path / 'full'}"]}  # fmt: skip
    results = run_train_batch(list(runs.values()), tmp_path)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    recs = {k: [json.loads(x) for x in (tmp_path / k / "metrics.jsonl").read_text().splitlines()] for k in runs}
    assert [r["step"] for r in recs["skip"]] == [r["step"] for r in recs["full"]] == [1, 2, 3]
    s, f = recs["skip"][0], recs["full"][0]
    assert 0 < s["adv_zero_variance_group_frac"] < 1 and s["trained_rows_frac"] < 1.0  # rows skipped in update 1
    assert s["reward_mean"] == f["reward_mean"]  # the same rollouts
    assert abs(s["grad_norm"] - f["grad_norm"]) <= 1e-5 * f["grad_norm"], (s["grad_norm"], f["grad_norm"])
    assert abs(s["loss"] - f["loss"]) <= 1e-6 + 1e-5 * abs(f["loss"])
    for s, f in zip(recs["skip"], recs["full"]):
        assert f["trained_rows_frac"] == 1.0
        zero_var = s["adv_zero_variance_group_frac"]  # groups of 4 with all-equal rewards: advantage 0
        assert s["trained_rows_frac"] == pytest.approx(max(1.0 - zero_var, 1 / 32))
    # the end-of-run speed summary counts the tokens each run really trained
    train = {k: json.loads((tmp_path / k / "summary.jsonl").read_text().splitlines()[-1])["phases"]["train"]
             for k in runs}  # fmt: skip
    frac = sum(r["trained_rows_frac"] for r in recs["skip"]) / 3
    assert 0.5 * frac < train["skip"]["tokens"] / train["full"]["tokens"] < 1.0, (train, frac)
