"""`hf` datasets from local jsonl/json/parquet files (and the hub path, with load_dataset stubbed)."""

import json
import logging

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mcore_rl.data import build_dataset

pytestmark = pytest.mark.rollout

ROWS = [
    {"q": "What is 2 + 3?", "sol": "5", "uid": "a", "extra": {"level": 1}},
    {"q": "Simplify \\frac{2}{4}.", "sol": "\\frac{1}{2}", "uid": "b", "extra": {"level": 3}},
    {"q": "What is 6 * 7?", "sol": 42, "uid": "c", "extra": {"level": 2}},
]
MAPPING = {"kind": "hf", "prompt_field": "q", "answer_field": "sol", "id_field": "uid",
           "metadata_fields": ["extra.level"], "system_prompt": "Be brief.",
           "prompt_template": "Q: {question}\nPut the answer in \\boxed{}."}


def _write(tmp_path, fmt: str):
    path = tmp_path / f"train.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif fmt == "json":
        path.write_text(json.dumps({"data": ROWS}))
    else:
        pq.write_table(pa.Table.from_pylist([{**r, "sol": str(r["sol"])} for r in ROWS]), path)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet"])
def test_local_files_with_field_mapping(tmp_path, fmt):
    path = _write(tmp_path, fmt)
    ds = build_dataset({**MAPPING, "path": str(path), "json_field": "data" if fmt == "json" else None})
    assert len(ds) == 3 and ds.summary.loaded == 3 and ds.summary.num_skipped == 0
    assert [r.prompt_id for r in ds] == ["a", "b", "c"]
    assert [r.answer for r in ds] == ["5", "\\frac{1}{2}", "42"]
    assert ds[1].prompt == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q: Simplify \\frac{2}{4}.\nPut the answer in \\boxed{}."},
    ]
    assert ds.by_id("c").metadata == {"source": f"train.{fmt}", "row": 2, "extra.level": 2}
    assert ds[0]["answer"] == "5"  # mapping-style access


def test_text_format_default_ids_and_transforms(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text(json.dumps({"question": "Tom has 3 ...", "answer": "3 + 4 = 7\n#### 1,007"}) + "\n")
    ds = build_dataset({"kind": "hf", "path": str(path), "prompt_format": "text", "answer_transform": "gsm8k"})
    assert ds[0].prompt == "Tom has 3 ..." and ds[0].answer == "1007" and ds[0].prompt_id == "gsm.jsonl:0"
    path2 = tmp_path / "math.jsonl"
    path2.write_text(json.dumps({"problem": "x?", "solution": "so \\boxed{\\frac{1}{2}}."}) + "\n")
    ds2 = build_dataset({"kind": "hf", "path": str(path2), "prompt_field": "problem", "answer_field": "solution",
                         "answer_transform": "boxed"})
    assert ds2[0].answer == "\\frac{1}{2}"


def test_chat_messages_in_the_prompt_field(tmp_path):
    path = tmp_path / "chat.jsonl"
    msgs = [{"role": "user", "content": "What is 1 + 1?"}]
    path.write_text(json.dumps({"prompt": msgs, "reward_model": {"ground_truth": "2"}}) + "\n")
    ds = build_dataset({"kind": "hf", "path": str(path), "prompt_field": "prompt",
                        "answer_field": "reward_model.ground_truth"})
    assert ds[0].prompt == msgs and ds[0].answer == "2"


def test_malformed_rows_are_counted_located_and_skipped(tmp_path, caplog):
    a = tmp_path / "a.jsonl"
    a.write_text("\n".join([
        json.dumps({"question": "ok 1", "answer": "1"}),        # row 0 ok
        '{"question": "broken", "answer": ',                     # row 1 bad json
        json.dumps({"answer": "2"}),                             # row 2 missing question
        json.dumps({"question": ["not", "text"], "answer": "3"}),  # row 3 non-string prompt
        json.dumps({"question": "empty answer", "answer": "  "}),  # row 4 empty answer
        "",                                                      # blank line: not a row
        json.dumps([1, 2]),                                      # row 6 not an object
        json.dumps({"question": "ok 2", "answer": 7}),           # row 7 ok (numeric answer)
    ]) + "\n")
    b = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "fine", "answer": "4"}, {"question": "q", "answer": None}]), b)
    with caplog.at_level(logging.WARNING, logger="mcore_rl.data"):
        ds = build_dataset({"kind": "hf", "path": [str(a), str(b)]})
    s = ds.summary
    assert [r.prompt_id for r in ds] == ["a.jsonl:0", "a.jsonl:7", "b.parquet:0"]
    assert (s.total_rows, s.loaded, s.num_skipped) == (9, 3, 6)
    assert dict(s.skipped) == {"bad_json": 1, "missing_field": 2, "non_string_prompt": 1, "empty_answer": 1,
                               "not_an_object": 1}
    assert [(b.file, b.row, b.reason.split(":")[0]) for b in s.bad_rows] == [
        ("a.jsonl", 1, "bad_json"), ("a.jsonl", 2, "missing_field"), ("a.jsonl", 3, "non_string_prompt"),
        ("a.jsonl", 4, "empty_answer"), ("a.jsonl", 6, "not_an_object"), ("b.parquet", 1, "missing_field"),
    ]
    assert s.bad_rows[5].reason == "missing_field:answer"
    warn = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warn) == 1 and "loaded 3/9 rows; skipped 6" in warn[0] and "a.jsonl row 1: bad_json" in warn[0]


def test_duplicate_ids_are_skipped(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"id": 1, "question": f"q{i}", "answer": "1"}) + "\n" for i in range(3)))
    ds = build_dataset({"kind": "hf", "path": str(path), "id_field": "id"})
    assert len(ds) == 1 and ds.summary.skipped["duplicate_id"] == 2


def test_field_missing_from_every_row_is_a_clear_error(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text("".join(json.dumps({"problem": "p", "solution": "s"}) + "\n" for _ in range(3)))
    with pytest.raises(ValueError, match=r"data.prompt_field='question' is missing from every row of x.jsonl; "
                                         r"available columns: \['problem', 'solution'\]"):
        build_dataset({"kind": "hf", "path": str(path)})


@pytest.mark.parametrize(
    "path, error, match",
    [
        ("missing/train.jsonl", FileNotFoundError, "does not exist"),
        ("./nope", FileNotFoundError, "does not exist"),
        ("nothing-*.jsonl", FileNotFoundError, "matched no files"),
    ],
)
def test_bad_local_paths(tmp_path, monkeypatch, path, error, match):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error, match=match):
        build_dataset({"kind": "hf", "path": path})


def test_directory_and_glob(tmp_path):
    (tmp_path / "d").mkdir()
    for i in range(2):
        (tmp_path / "d" / f"part{i}.jsonl").write_text(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n")
    (tmp_path / "d" / "notes.txt").write_text("ignored")
    assert [r.answer for r in build_dataset({"kind": "hf", "path": str(tmp_path / "d")})] == ["0", "1"]
    assert len(build_dataset({"kind": "hf", "path": str(tmp_path / "d" / "part*.jsonl")})) == 2
    with pytest.raises(ValueError, match="unsupported extension '.txt'"):
        build_dataset({"kind": "hf", "path": str(tmp_path / "d" / "notes.txt")})


def test_hub_id_goes_to_load_dataset(monkeypatch):
    calls = []

    def fake_load_dataset(path, name=None, split=None, revision=None):
        calls.append((path, name, split, revision))
        return datasets.Dataset.from_list([{"question": "1 + 1?", "answer": "#### 2"}, {"question": "x", "answer": ""}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ds = build_dataset({"kind": "hf", "path": "openai/gsm8k", "subset": "main", "split": "test",
                        "answer_transform": "gsm8k"})
    assert calls == [("openai/gsm8k", "main", "test", None)]
    assert [(r.prompt_id, r.answer) for r in ds] == [("openai/gsm8k/test:0", "2")]
    assert ds.summary.bad_rows[0].file == "openai/gsm8k/test" and ds.summary.bad_rows[0].row == 1


def test_unreachable_hub_names_the_path():
    with pytest.raises(ValueError, match=r"data.path='no-such-org/no-such-dataset-xyz' is not a local file"):
        build_dataset({"kind": "hf", "path": "no-such-org/no-such-dataset-xyz"})


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match="data.kind='csv': expected one of arithmetic, champ, hf, reasoning_gym"):
        build_dataset({"kind": "csv"})
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['promt_field'\]"):
        build_dataset({"kind": "hf", "path": "x.jsonl", "promt_field": "q"})
    with pytest.raises(ValueError, match="must contain '{question}'"):
        build_dataset({"kind": "arithmetic", "prompt_template": "no placeholder"})
