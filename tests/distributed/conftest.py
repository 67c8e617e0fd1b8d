from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.distributed.nccl_standin import StrictCollectives, install


@pytest.fixture(scope="module")
def world():
    """One gloo rank with Megatron's groups (what `init_distributed` builds on a CPU machine), plus a separate
    gloo group standing for the host group `init_distributed` adds when the default backend is NCCL."""
    from mcore_rl.distributed import init_distributed

    layout = init_distributed(1, 1, timeout_s=321)
    return layout, dist.new_group(backend="gloo")


@pytest.fixture
def nccl(world, monkeypatch) -> StrictCollectives:
    return install(monkeypatch, world[1], nccl=True)


@pytest.fixture
def gloo(world, monkeypatch) -> StrictCollectives:
    return install(monkeypatch, world[1], nccl=False)
