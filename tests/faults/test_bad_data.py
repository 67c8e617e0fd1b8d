"""Bad data is counted and skipped at load with its file/row: undecodable bytes, too-deep nesting, and prompts
longer than the context minus max_new_tokens. Training goes on, and a resume never meets the skipped row."""

from __future__ import annotations

import json

import pytest

from mcore_rl.data import build_dataset
from mcore_rl.data.filters import drop_overlong
from tests.faults.faultlib import records, train

pytestmark = pytest.mark.faults


def _row(q: str, a: str = "2") -> bytes:
    return (json.dumps({"question": q, "answer": a}) + "\n").encode()


def test_undecodable_and_too_deep_rows_are_counted_with_file_and_row(tmp_path):
    f = tmp_path / "train.jsonl"
    deep = "[" * 100 + "]" * 100
    abyss = "[" * 100_000 + "]" * 100_000  # past the parser's own recursion limit
    f.write_bytes(_row("What is 1 + 1?") + b'{"question": "caf\xe9?", "answer": "1"}\n'
                  + f'{{"question": {deep}, "answer": "1"}}\n'.encode() + abyss.encode() + b"\n"
                  + _row("What is 0 + 2?") + b'{"question": \n')
    ds = build_dataset({"kind": "hf", "path": str(f)})
    s = ds.summary
    assert s.loaded == 2 and s.total_rows == 6
    assert dict(s.skipped) == {"undecodable": 1, "too_deep": 2, "bad_json": 1}
    assert [(b.row, b.reason.split(":")[0]) for b in s.bad_rows] == [
        (1, "undecodable"), (2, "too_deep"), (3, "too_deep"), (5, "bad_json")]
    assert "train.jsonl row 1: undecodable:invalid continuation byte at byte 17" in s.line()


def test_drop_overlong_counts_rows_and_keeps_order(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_bytes(b"".join(_row("x" * n) for n in (10, 500, 20, 30)))
    ds = build_dataset({"kind": "hf", "path": str(f)})
    kept = drop_overlong(ds, lambda r: len(r.prompt[-1]["content"]), max_new_tokens=64, context=160)
    assert [len(r.prompt[-1]["content"]) for r in kept] == [10, 20, 30]
    assert kept.summary.loaded == 3 and dict(kept.summary.skipped) == {"prompt_too_long": 1}
    assert "t.jsonl row 1: prompt_too_long:500 prompt tokens + 64 new > context 160" in kept.summary.line()
    with pytest.raises(ValueError, match="every prompt is longer than the context"):
        drop_overlong(ds, lambda r: 10_000, max_new_tokens=8, context=100)


def test_overlong_prompt_skipped_training_and_resume_go_on(tmp_path):
    data = tmp_path / "train.jsonl"
    rows = [_row(f"What is {i} + {i}?", str(2 * i)) for i in range(4)]
    rows.insert(2, _row("count the words: " + "word " * 2100))  # > 2048-token context of the tiny model
    data.write_bytes(b"".join(rows))
    run_dir = tmp_path / "run"
    common = ["data=jsonl", f"data.path={data}", "trainer.save_every=1", "trainer.export_hf=false", f"run.dir={run_dir}"]
    proc = train("trainer.steps=2", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train.jsonl row 2: prompt_too_long:" in proc.stderr and "+ 8 new > context 2048" in proc.stderr
    # 4 usable prompts, 2 per update: updates 3-4 start a new epoch. Without the filter the long row would come
    # up there (the order is deterministic), after the resume as before it.
    proc = train("trainer.steps=4", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr
    recs = records(run_dir)
    assert sorted(recs) == [1, 2, 3, 4]
    assert all(recs[s]["data_rows_skipped"] == 1.0 for s in recs)
    assert recs[4]["data_epoch"] == 1.0
