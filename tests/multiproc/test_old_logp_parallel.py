"""The exact old-log-prob sources under tensor and pipeline parallelism (torchrun, gloo): each rank keeps and
swaps its own shard; values equal the per-version reloaded reference. ~3-5 min per case on 2 shared cores."""

from __future__ import annotations

import pytest

from tests.e2e.test_old_logp_exact import EXACT, async_run, check_exact

pytestmark = [pytest.mark.multiproc, pytest.mark.algorithms, pytest.mark.slow]
LAYOUTS = {"tp2": ["parallel=tp2"], "pp2": ["parallel.pp=2"]}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("source", EXACT)
def test_exact_old_logp_parallel(layout, source, tmp_path):
    check_exact(async_run(tmp_path, source, 2, *LAYOUTS[layout]), source)
