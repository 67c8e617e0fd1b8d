"""From one torch_dist checkpoint, TP/PP/DP layouts give TP=1 log-probs, grad norms and post-step log-probs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.launch import assert_same_step, assert_step_moved, layout_run, reference_run

pytestmark = pytest.mark.multiproc
WORKER = Path(__file__).with_name("parallel_worker.py")

LAYOUTS = {  # name: (nproc, tp, pp, extra args)
    "tp2": (2, 2, 1, []),
    "pp2": (2, 1, 2, []),
    "tp2pp2": (4, 2, 2, []),
    "dp2": (2, 1, 1, []),
    "dp2_distopt": (2, 1, 1, ["--distributed-optimizer"]),
}


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, tmp_path_factory):
    return reference_run(WORKER, tiny_llama_dir, tmp_path_factory.mktemp("par"))


# slow: TP=2 and PP=2 alone; tp2pp2 (4 ranks) runs both splits, and their interaction, in the default suite, and
# tests/lora/test_lora_parallel.py runs the base model at tp2 and pp2 alone
SLOW = {"tp2", "pp2"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in LAYOUTS])
def test_layout_matches_tp1(name, reference, tiny_llama_dir, tmp_path):
    ckpt, ref = reference
    nproc, tp, pp, extra = LAYOUTS[name]
    got = layout_run(WORKER, nproc, tiny_llama_dir, ckpt, tmp_path / f"{name}.pt", "--tp", str(tp), "--pp", str(pp),
                     *extra)
    assert_step_moved(ref)
    assert_same_step(got, ref)
