"""The Transformer Engine spec gets Megatron's fused kernels and DDP's overlapped gradient reduce; the local (CPU)
spec keeps every fusion off. Checked on the config dicts, without building TE (absent here)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mcore_rl.models import spec
from mcore_rl.models.base import family_for
from mcore_rl.models.spec import BuildConfig, ddp_config_kwargs, resolve_impl
from mcore_rl.policy.build import transformer_config_dict

FUSIONS = (
    "bias_activation_fusion",
    "masked_softmax_fusion",
    "apply_rope_fusion",
    "bias_dropout_fusion",
    "gradient_accumulation_fusion",
)


def _args():
    hf = dict(
        architectures=["LlamaForCausalLM"],
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    return family_for(hf).args(hf)


def test_te_spec_turns_the_fusions_on_only_where_te_and_cuda_are(monkeypatch):
    build = BuildConfig(transformer_impl="auto")
    assert resolve_impl(build) == "local"  # this machine: no CUDA, no TE
    local = transformer_config_dict(_args(), build, resolve_impl(build))
    assert {k: local[k] for k in FUSIONS} == dict.fromkeys(FUSIONS, False)
    monkeypatch.setattr(spec, "te_available", lambda: True)  # a GPU node with TE installed
    impl = resolve_impl(build)
    assert impl == "transformer_engine"
    te = transformer_config_dict(_args(), build, impl)
    assert {k: te[k] for k in FUSIONS} == dict.fromkeys(FUSIONS, True)
    frozen = transformer_config_dict(_args(), build, impl, trainable=False)  # no main_grad to accumulate into
    assert frozen["gradient_accumulation_fusion"] is False and frozen["apply_rope_fusion"] is True
    # everything else identical: the fusions change kernels, not the model
    assert {k: v for k, v in te.items() if k not in FUSIONS} == {
        k: v for k, v in local.items() if k not in FUSIONS
    }


def test_ddp_overlaps_the_gradient_reduce_on_the_te_path():
    from megatron.core.distributed import DistributedDataParallelConfig

    te = DistributedDataParallelConfig(
        **ddp_config_kwargs("transformer_engine", use_distributed_optimizer=True)
    )
    assert te.overlap_grad_reduce and te.use_distributed_optimizer and te.grad_reduce_in_fp32
    assert not te.overlap_param_gather  # weights are read right after each step (see ddp_config_kwargs)
    local = DistributedDataParallelConfig(**ddp_config_kwargs("local", use_distributed_optimizer=True))
    assert not local.overlap_grad_reduce and not local.overlap_param_gather
    assert {f.name for f in dataclasses.fields(DistributedDataParallelConfig)} >= set(
        ddp_config_kwargs("local", False)
    )


@pytest.mark.multiproc
def test_overlapped_reduce_waits_for_the_last_micro_batch(monkeypatch, tiny_llama_dir):
    """overlap_grad_reduce needs the schedule's no_sync hook (build_gpt_model wires it). Megatron starts a
    bucket's reduce once every param reported as many grads as in the first step; token-budget micro-batches
    vary in number between updates, so without no_sync (which counts the last micro-batch only) an update with
    fewer micro-batches than the first never starts its reduce, and finish_grad_sync fails. Spied: when each
    bucket reduce starts, in forward passes of the update; and the gradients equal the plain reduce's."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    from mcore_rl.distributed import init_distributed
    from mcore_rl.policy import build
    from mcore_rl.policy.policy import Policy, PolicyConfig
    from mcore_rl.policy.step import PolicyBatch

    init_distributed(1, 1)
    g = torch.Generator().manual_seed(5)
    batches = [PolicyBatch(torch.randint(0, 512, (n, 20), generator=g), torch.ones(n, 20)) for n in (6, 4)]
    started: list[int] = []
    forwards = [0]
    real_start = _ParamAndGradBucketGroup.start_grad_sync

    def spy(self, *a, **k):
        started.append(forwards[0])
        return real_start(self, *a, **k)

    monkeypatch.setattr(_ParamAndGradBucketGroup, "start_grad_sync", spy)

    def grads(overlap: bool) -> torch.Tensor:
        kw = ddp_config_kwargs("transformer_engine" if overlap else "local", False)
        monkeypatch.setattr(build, "ddp_config_kwargs", lambda impl, dist_opt: kw)
        pol = Policy(tiny_llama_dir, PolicyConfig(token_budget=40))  # 2 rows per micro-batch
        pol.load_hf(tiny_llama_dir)
        pol.gpt.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
        assert pol.model.ddp_config.overlap_grad_reduce == overlap
        for batch in batches:  # 3 micro-batches, then 2
            forwards[0] = 0
            started.clear()
            pol.model.zero_grad_buffer()
            # the schedule's finalize_model_grads waits for the reduces (finish_grad_sync)
            pol.forward_backward(batch, lambda mb, logp, ent: (-(logp * mb.loss_mask).sum() / 120, {}))
        assert forwards[0] == 2
        return torch.cat([p.main_grad.flatten() for p in pol.model.parameters()])

    plain = grads(False)
    overlapped = grads(True)
    assert started and set(started) == {2}  # every bucket's reduce right after the last micro-batch
    assert plain.abs().sum().item() > 0
    assert torch.allclose(plain, overlapped, rtol=0, atol=1e-7)
