"""Reward fixtures: a tokenizer-only reward model folder (SmolLM2's tokenizer and chat template, two logits)."""

from __future__ import annotations

import pytest

from tests.rewards.rm_fixture import make_tokenizer_only_rm


@pytest.fixture(scope="session")
def rm_dir(smollm2_dir, tmp_path_factory):
    return make_tokenizer_only_rm(tmp_path_factory.mktemp("rm_tok"), smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_rm_dir(smollm2_dir, tmp_path_factory):
    """The real test RM (rm_fixture.make_smollm2_rm): SmolLM2's trunk under a seeded one-logit score head."""
    from tests.rewards.rm_fixture import make_smollm2_rm

    return make_smollm2_rm(tmp_path_factory.getbasetemp() / "smollm2_rm_seed0", seed=0)
