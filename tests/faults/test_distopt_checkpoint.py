"""Megatron's distributed optimizer (one gloo rank, tiny dense Llama, torch's Adam as on any machine without
TE/Apex) through mcore-rl's dist checkpoint: the save works (Megatron-Core 0.16.1's default optimizer format is
refused by its own checkpointing), a *fresh* policy resumes from it, and its next step equals the uninterrupted one
bitwise. Each torch-Adam neutralisation of compat/distopt.py is hit (and counted) on the way."""

from __future__ import annotations

import pytest
import torch

from tests.train_step import train_step

pytestmark = [pytest.mark.faults, pytest.mark.multiproc]  # real Megatron modules on one gloo rank


def _policy(model_dir, distributed: bool = True):
    from mcore_rl.config.optim import OptimSettings
    from mcore_rl.distributed import init_distributed
    from mcore_rl.policy.policy import Policy, PolicyConfig

    init_distributed(1, 1)
    optim = OptimSettings(lr=1e-3, weight_decay=0.01, clip_grad=0.0, use_distributed_optimizer=distributed)
    pol = Policy(model_dir, PolicyConfig(token_budget=64, optim=optim))
    pol.load_hf(model_dir)
    return pol


def test_distributed_optimizer_resumes_bitwise(tiny_llama_dir, tmp_path):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from mcore_rl.checkpoint_io import OPTIMIZER_METADATA, load_dist_checkpoint, save_dist_checkpoint
    from mcore_rl.compat import distopt
    from tests.multiproc.launch import fixed_batch, loss_fn

    first = _policy(tiny_llama_dir)
    assert isinstance(first.optimizer.chained_optimizers[0], DistributedOptimizer)
    batch, mask = fixed_batch(first.args.vocab_size)
    train_step(first, batch, loss_fn)
    after_1 = first.logprobs(batch) * mask
    save_dist_checkpoint(tmp_path / "step_1", first.model, first.optimizer)
    assert OPTIMIZER_METADATA["distrib_optim_sharding_type"] == "fully_reshardable"
    train_step(first, batch, loss_fn)
    straight = first.logprobs(batch) * mask
    assert (straight - after_1).abs().max().item() > 1e-3  # step 2 moves the policy: the comparison can fail

    distopt.HITS.clear()
    resumed = _policy(tiny_llama_dir)  # a fresh optimizer, as after a crash
    load_dist_checkpoint(tmp_path / "step_1", resumed.model, resumed.optimizer)
    resumed._sync_main_params()
    assert torch.equal(resumed.logprobs(batch) * mask, after_1)
    train_step(resumed, batch, loss_fn)
    assert torch.equal(resumed.logprobs(batch) * mask, straight)
    n_params = sum(len(g["params"]) for g in resumed.optimizer.chained_optimizers[0].optimizer.param_groups)
    assert distopt.HITS["distrib_optimizer.state_dict: fresh torch Adam state created"] == 1
    assert distopt.HITS["distrib_optimizer._set_main_param_and_optimizer_states: step kept"] == n_params
    assert distopt.HITS["distrib_optimizer.load_state_dict: shared step tensor copied"] >= n_params - 1


@pytest.mark.parametrize("distributed", [False, True], ids=["adam", "distributed_optimizer"])
def test_a_checkpoint_before_the_first_step_resumes(tiny_llama_dir, tmp_path, distributed):
    """A run preempted before its first update (SIGTERM during the first rollout) checkpoints at update 0, when
    Adam has no moments yet. That checkpoint holds no optimizer entries and says so; the resumed run loads the
    weights, keeps its fresh optimizer, and its first step equals the uninterrupted run's bitwise. (Before, the
    load asked for moments the save never wrote: KeyError 'optimizer.state.exp_avg...' and a run that could not
    resume.)"""
    import json

    from mcore_rl import checkpoint_io as ckpt
    from tests.multiproc.launch import fixed_batch, loss_fn

    first = _policy(tiny_llama_dir, distributed)
    batch, mask = fixed_batch(first.args.vocab_size)
    ckpt.save_dist_checkpoint(tmp_path / "step_0", first.model, first.optimizer)
    before = first.logprobs(batch) * mask
    train_step(first, batch, loss_fn)
    straight = first.logprobs(batch) * mask
    assert (straight - before).abs().max().item() > 1e-3  # the step moves the policy: the comparison can fail
    ckpt.save_dist_checkpoint(tmp_path / "step_1", first.model, first.optimizer)

    resumed = _policy(tiny_llama_dir, distributed)
    ckpt.load_dist_checkpoint(tmp_path / "step_0", resumed.model, resumed.optimizer)
    if distributed:
        resumed._sync_main_params()
    assert torch.equal(resumed.logprobs(batch) * mask, before)
    train_step(resumed, batch, loss_fn)
    assert torch.equal(resumed.logprobs(batch) * mask, straight)
    marks = [json.loads((tmp_path / d / ckpt.COMPLETE).read_text()).get(ckpt.OPTIMIZER_SAVED) for d in ("step_0", "step_1")]
    assert marks == [False, True]
