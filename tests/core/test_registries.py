"""The seven registries on `Registry[T]`: names known without importing the implementations, only the chosen
module loaded, every built-in module registering the names it is listed for, and config choices checked against
the registry (a name registered by user code is accepted where a copied tuple would refuse it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# (module declaring the registry, its attribute, a built-in name, that name's module: not imported until asked)
REGISTRIES = [
    ("mcore_rl.algorithms.registry", "ALGORITHMS", "grpo", "mcore_rl.algorithms.grpo"),
    ("mcore_rl.oldlogp.registry", "SOURCES", "snapshot", "mcore_rl.oldlogp.snapshot"),
    ("mcore_rl.rollout.protocol", "ENGINES", "local", "mcore_rl.rollout.local.engine"),
    ("mcore_rl.rollout.weight_sync.transports", "TRANSPORTS", "disk", None),  # the transports live beside it
    ("mcore_rl.rewards.registry", "REWARDS", "format", None),  # the package exports both rewards
    ("mcore_rl.data.registry", "DATASETS", "champ", "mcore_rl.data.champ"),
    ("mcore_rl.models.base", "FAMILIES", "Qwen3MoeForCausalLM", "mcore_rl.models.qwen3_moe"),
]

_PROBE = """
import importlib, json, sys
out = {}
for decl, attr, name, impl in json.loads(sys.argv[1]):
    reg = getattr(importlib.import_module(decl), attr)
    before = impl in sys.modules if impl else None
    names = reg.names()
    listed = name in reg and impl not in sys.modules if impl else name in reg
    reg.get(name)
    out[attr] = {"names": names, "before": before, "listed_without_import": listed,
                 "after": impl in sys.modules if impl else None, "kind": reg.kind}
print(json.dumps(out))
"""


def test_names_without_import_and_lazy_get():
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(REGISTRIES)], capture_output=True, text=True,
                          cwd=REPO, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for _, attr, _, impl in REGISTRIES:
        got = out[attr]
        assert got["listed_without_import"], (attr, got)
        if impl:
            assert (got["before"], got["after"]) == (False, True), (attr, got)
    assert out["ALGORITHMS"]["names"] == [
        "cispo",
        "dapo",
        "dr_grpo",
        "grpo",
        "gspo",
        "mu_grpo",
        "p3o",
        "ppo_ewma",
        "reinforce_pp",
        "rloo",
        "scalerl",
    ]
    assert out["SOURCES"]["names"] == ["interrupt", "old_logit_model", "recompute", "rollout", "snapshot"]
    assert out["ENGINES"]["names"] == ["local", "sglang"]
    assert out["TRANSPORTS"]["names"] == ["disk", "nccl", "tensor"]
    assert out["REWARDS"]["names"] == ["format", "function", "judge", "math_verify", "remote", "rm"]
    assert out["DATASETS"]["names"] == ["arithmetic", "champ", "hf", "reasoning_gym"]
    assert out["FAMILIES"]["names"] == [
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM"]  # fmt: skip
    kinds = {attr: out[attr]["kind"] for attr in out}
    assert kinds == {"ALGORITHMS": "algorithm.name", "SOURCES": "algorithm.old_logp_source",
                     "ENGINES": "rollout.engine", "TRANSPORTS": "rollout.sync_mode", "REWARDS": "reward.name",
                     "DATASETS": "data.kind", "FAMILIES": "architecture"}  # fmt: skip


@pytest.mark.parametrize("decl, attr", [(d, a) for d, a, _, _ in REGISTRIES])
def test_every_builtin_module_registers_its_names(decl, attr):
    import importlib

    reg = getattr(importlib.import_module(decl), attr)
    loaded = reg.load_all()  # raises RegistryError for a listed module that does not register its name
    assert sorted(loaded) == reg.names() and all(v is not None for v in loaded.values())


def test_unknown_choices_are_one_line_errors():
    from mcore_rl.algorithms import build_algorithm
    from mcore_rl.data import build_dataset
    from mcore_rl.oldlogp.registry import build_source
    from mcore_rl.registry import RegistryError
    from mcore_rl.rewards import build_reward
    from mcore_rl.rollout.protocol import build_engine
    from mcore_rl.rollout.weight_sync.transports import SyncOptions, send_weights

    cases = [
        (
            lambda: build_algorithm({"name": "gpro"}),
            "algorithm.name='gpro': expected one of cispo, dapo, dr_grpo",
        ),
        (lambda: build_source("snap", None), "algorithm.old_logp_source='snap': expected one of interrupt, "),
        (lambda: build_engine("vllm"), "rollout.engine='vllm': expected one of local, sglang"),
        (
            lambda: send_weights("ipc", None, [], 1, SyncOptions()),
            "rollout.sync_mode='ipc': expected one of disk, ",
        ),
        (lambda: build_reward({"name": "format+lenght"}), "reward.name='lenght': expected one of format, "),
        (lambda: build_dataset({"kind": "csv"}), "data.kind='csv': expected one of arithmetic, champ, hf, "),
    ]
    for call, message in cases:
        with pytest.raises(RegistryError) as e:
            call()
        assert str(e.value).startswith(message) and "\n" not in str(e.value)
        # config validation turns ValueErrors into exit-2 config errors
        assert isinstance(e.value, ValueError)


def test_model_family_error_lists_the_registry():
    from mcore_rl.models.base import family_for

    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\]; supported: Llama"):
        family_for({"architectures": ["GPT2LMHeadModel"]})
    assert type(family_for({"model_type": "qwen2"})).__name__ == "Qwen2Family"


def test_algorithm_config_reads_old_logit_choices_from_the_registry():
    """A user-registered source is a valid `algorithm.old_logp_source` (no copied tuple of names to update), and
    its `exact` flag decides the ppo_ewma route."""
    from mcore_rl.algorithms import build_algorithm
    from mcore_rl.oldlogp.base import OldLogpSource
    from mcore_rl.oldlogp.registry import SOURCES, register_source

    with pytest.raises(ValueError, match="old_logp_source='mine' is not one of"):
        build_algorithm({"name": "grpo", "old_logp_source": "mine"})

    @register_source("mine")
    class Mine(OldLogpSource):
        exact = True

    try:
        assert build_algorithm({"name": "grpo", "old_logp_source": "mine"}).config.old_logp_source == "mine"
        assert build_algorithm({"name": "ppo_ewma", "old_logp_source": "mine"}).config.exact is True
        assert build_algorithm({"name": "ppo_ewma", "old_logp_source": "rollout"}).config.exact is False
    finally:
        del SOURCES._entries["mine"]
