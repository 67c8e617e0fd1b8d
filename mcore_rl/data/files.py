"""Local prompt files: resolve paths (file, directory, glob, list) and read rows, keeping row indices.

Why our own jsonl/json reader instead of `datasets`' json builder: one bad line makes the builder fail the
whole file without saying which row; here a bad line becomes a counted, located, skipped row.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# (row index, row object) or (row index, BadJson(reason)) for every row of a file.
RowIter = Iterator[tuple[int, Any]]


class BadJson(str):
    """Marks a row that could not be decoded (value = the reason)."""


MAX_DEPTH = 64  # deeper rows are junk or an attack on the parser, never a prompt


def _depth(obj: Any) -> int:
    """Nesting depth of a decoded JSON value, without recursion."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        x, d = stack.pop()
        deepest = max(deepest, d)
        if d > MAX_DEPTH:
            break
        if isinstance(x, dict):
            stack += [(v, d + 1) for v in x.values()]
        elif isinstance(x, list):
            stack += [(v, d + 1) for v in x]
    return deepest


def _decode_row(raw: bytes) -> Any:
    """One JSON line -> the row, or BadJson naming why it cannot be one (bytes, syntax, nesting)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return BadJson(f"undecodable:{e.reason} at byte {e.start}")
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        return BadJson(f"bad_json:{e.msg} at column {e.colno}")
    except RecursionError:
        return BadJson(f"too_deep:nesting beyond the parser's limit (max {MAX_DEPTH})")
    if _depth(row) > MAX_DEPTH:
        return BadJson(f"too_deep:nesting deeper than {MAX_DEPTH}")
    return row


def _jsonl_rows(path: Path, json_field: str | None) -> RowIter:
    with path.open("rb") as f:
        for i, raw in enumerate(f):
            if not raw.strip():
                continue
            yield i, _decode_row(raw)


def _json_rows(path: Path, json_field: str | None) -> RowIter:
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        yield from _jsonl_rows(path, json_field)  # a .json file holding JSON lines, like HF's json builder
        return
    if isinstance(data, dict):
        if json_field is None or json_field not in data:
            raise ValueError(
                f"{path} holds a JSON object, not a list of rows: set data.json_field to the key with the rows "
                f"(keys: {sorted(data)[:20]})"
            )
        data = data[json_field]
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of row objects, got {type(data).__name__}")
    for i, row in enumerate(data):
        yield i, row if _depth(row) <= MAX_DEPTH else BadJson(f"too_deep:nesting deeper than {MAX_DEPTH}")


def _parquet_rows(path: Path, json_field: str | None) -> RowIter:
    import pyarrow.parquet as pq  # ships with `datasets`

    yield from enumerate(pq.read_table(path).to_pylist())


READERS: dict[str, Callable[[Path, str | None], RowIter]] = {
    ".jsonl": _jsonl_rows,
    ".json": _json_rows,
    ".parquet": _parquet_rows,
}


# A missing path with one of these suffixes is a typo'd file, not a hub id ("AI-MO/NuminaMath-1.5" is an id).
_FILE_LIKE = {*READERS, ".csv", ".tsv", ".txt", ".gz", ".zst", ".arrow"}


def _is_glob(p: str) -> bool:
    return any(c in p for c in "*?[")


def resolve_local(path: str | list[str]) -> list[Path] | None:
    """Local files named by `path`, or None when `path` looks like a hub id (no such file, no extension)."""
    paths = [path] if isinstance(path, str) else list(path)
    if not paths or not all(isinstance(p, str) and p for p in paths):
        raise ValueError(f"data.path must be a non-empty string or list of strings; got {path!r}")
    files: list[Path] = []
    for p in paths:
        q = Path(p).expanduser()
        if _is_glob(p):
            found = sorted(Path(m) for m in glob.glob(str(q), recursive=True) if Path(m).is_file())
            if not found:
                raise FileNotFoundError(f"data.path glob {p!r} matched no files")
            files += found
        elif q.is_dir():
            found = sorted(f for f in q.rglob("*") if f.suffix in READERS and f.is_file())
            if not found:
                raise FileNotFoundError(f"data.path directory {p!r} has no {sorted(READERS)} files")
            files += found
        elif q.is_file():
            files.append(q)
        elif q.suffix in _FILE_LIKE or p.startswith(("/", ".", "~")) or len(paths) > 1:
            raise FileNotFoundError(f"data.path {p!r} does not exist (and is not a Hugging Face hub id)")
        else:
            return None
    for f in files:
        if f.suffix not in READERS:
            raise ValueError(f"data.path {str(f)!r}: unsupported extension {f.suffix!r}; use {sorted(READERS)}")
    return files


def read_rows(path: Path, json_field: str | None = None) -> RowIter:
    return READERS[path.suffix](path, json_field)
