"""Durable filesystem writes: the one place that writes a folder atomically and fsyncs a tree.

Why: `os.replace` is atomic but not durable. After a power loss or node crash the rename can survive while the
file contents it points at were never flushed, so a folder that looks complete holds empty files. The rule here:
fsync every file and every directory of a staged folder *before* its rename, and the parent directory *after*
it (the rename itself is a change to the parent). Deleting a folder first renames it out of the namespace that
readers scan (to `<name>.old`), so a half-deleted folder can never look complete. Leftover `.tmp`/`.old`
folders from a crash are swept by `sweep_stale`.

Every fsync is reported to `mcore_rl.faults.log_fsync` (the fault suite's power-loss simulation reads it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from mcore_rl.faults import log_fsync

TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"


def _fsync(path: str | Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    log_fsync(Path(path))


def fsync_file(path: str | Path) -> None:
    _fsync(path, os.O_RDONLY)


def fsync_dir(path: str | Path) -> None:
    """Persist a directory's entries (creations, renames, unlinks inside it)."""
    _fsync(path, os.O_RDONLY | os.O_DIRECTORY)


def fsync_tree(root: str | Path) -> None:
    """fsync every file under `root`, then every directory bottom-up (children before the entries naming them)."""
    root = Path(root)
    dirs: list[str] = []
    for dirpath, _, files in os.walk(root):
        dirs.append(dirpath)
        for f in files:
            p = os.path.join(dirpath, f)
            if not os.path.islink(p):
                fsync_file(p)
    for d in reversed(dirs):
        fsync_dir(d)


def write_file_atomic(path: str | Path, data: str | bytes) -> None:
    """Replace `path` with `data`: write a sibling temp file, fsync it, rename, fsync the parent."""
    path = Path(path)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    log_fsync(tmp)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def staging_path(final: str | Path) -> Path:
    final = Path(final)
    return final.with_name(final.name + TMP_SUFFIX)


def prepare_staging(final: str | Path, overwrite: bool = False) -> Path:
    """A fresh, empty `<final>.tmp` (a leftover from a crash is removed). Refuses an existing `final` unless
    `overwrite`."""
    final = Path(final)
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final} exists; pass overwrite/--force to replace it")
    tmp = staging_path(final)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    fsync_dir(tmp.parent)
    return tmp


def commit_staging(tmp: str | Path, final: str | Path, on_swap=None) -> Path:
    """Make a fully written `tmp` folder durable and rename it to `final` (replacing an existing one).

    Replacing goes final -> final.old, tmp -> final, then deletes final.old: at every instant either the old or
    the new folder sits at `final` or at a name `sweep_stale` recognises. `on_swap()` runs between the two renames
    (a crash-test hook)."""
    tmp, final = Path(tmp), Path(final)
    fsync_tree(tmp)
    if final.exists():
        old = _move_aside(final)
        if on_swap is not None:
            on_swap()
        os.replace(tmp, final)
        fsync_dir(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
        fsync_dir(final.parent)
    return final


def publish_new(tmp: str | Path, final: str | Path) -> bool:
    """Durably rename a fully written `tmp` to a `final` that must not exist yet (a cache entry several processes
    may race to create). Returns False, removing `tmp`, when another process published `final` first."""
    tmp, final = Path(tmp), Path(final)
    fsync_tree(tmp)
    try:
        os.replace(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
        discard(tmp)
        return False
    fsync_dir(final.parent)
    return True


def discard(path: str | Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(final: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """`with atomic_dir(out) as tmp:` write into `tmp`; on success it becomes `out` durably, on error it is
    removed and `out` (if any) is untouched. Single-process writers only (collective saves use the parts)."""
    tmp = prepare_staging(final, overwrite=overwrite)
    try:
        yield tmp
    except BaseException:
        discard(tmp)
        raise
    commit_staging(tmp, final)


def _move_aside(path: Path) -> Path:
    """Rename `path` to `<name>.old` (replacing a stale one) and make the rename durable; returns the new name."""
    old = path.with_name(path.name + OLD_SUFFIX)
    if old.exists():
        shutil.rmtree(old)
    os.replace(path, old)
    fsync_dir(path.parent)
    return old


def remove_tree(path: str | Path, on_renamed=None) -> None:
    """Delete a folder so that no crash leaves it half-deleted under its own name: rename it to `<name>.old`
    (durably) first, then delete. `on_renamed()` runs in between (a crash-test hook)."""
    path = Path(path)
    if not path.exists():
        return
    old = _move_aside(path)
    if on_renamed is not None:
        on_renamed()
    shutil.rmtree(old, ignore_errors=True)


def sweep_stale(root: str | Path, prefix: str = "") -> list[Path]:
    """Remove `<prefix>*.tmp` / `*.old` entries a crash left under `root`; returns what was removed."""
    root = Path(root)
    if not root.is_dir():
        return []
    gone = []
    for p in sorted(root.iterdir()):
        if p.name.startswith(prefix) and p.name.endswith((TMP_SUFFIX, OLD_SUFFIX)):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            gone.append(p)
    if gone:
        fsync_dir(root)
    return gone
