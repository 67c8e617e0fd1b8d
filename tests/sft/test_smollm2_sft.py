"""A short SFT of the real SmolLM2-135M-Instruct on a few demonstrations lowers its held-out loss."""

from __future__ import annotations

import pytest

from tests.sft.conftest import addition_rows, write_jsonl
from tests.sft.helpers import heldout, ok, records, sft


@pytest.mark.slow  # SmolLM2 forwards: ~30-60 s on 2 cores
def test_short_sft_lowers_the_heldout_loss(smollm2_dir, tmp_path):
    rows = write_jsonl(tmp_path / "rows.jsonl", addition_rows(24))
    run_dir = tmp_path / "run"
    ok(
        sft(
            [
                "model=smollm2",
                "model.dtype=fp32",
                "model.load_check.enabled=false",
                f"sft.data.path={rows}",
                "sft.data.heldout_fraction=0.25",
                "sft.epochs=2",
                "sft.batch_size=6",
                "optim.lr=5e-5",
                "sft.export_hf=false",
                "logging.progress=false",
                f"run.dir={run_dir}",
            ],
            timeout=900,
        )
    )
    evals = heldout(run_dir)
    assert sorted(evals) == [0, 6], evals  # 18 train rows / 6 per step, 2 epochs; 6 rows held out
    assert evals[6] < 0.8 * evals[0], evals  # the answer format is learned, not noise
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3, 4, 5, 6]
