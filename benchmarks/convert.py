"""Conversion throughput vs the disk: HF -> mcore and mcore -> HF GB/s, next to a raw read+write of the same bytes.

Usage: python benchmarks/convert.py [--hf DIR] [--tp N --pp M] [--repeats 3] [--workdir DIR]

Raw = read every source file and write the same number of bytes to one file in the work dir, then fsync (the
converters fsync their outputs too). Both sides read a warm page cache (the source was read just before), so the
ratio isolates what conversion adds: model build, layout shuffles, checkpoint metadata. Runs alternate
(convert, raw, convert, ...) and start after os.sync(), so both see the same disk and machine load. Conversion times are taken
in-process after a warm-up run, i.e. without the one-off Python/Megatron import cost (printed separately).
Default model: SmolLM2-135M-Instruct, fp32 (538 MB).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
CHUNK = 64 << 20


def files_of(folder: Path, exts: tuple[str, ...]) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and (p.suffix in exts or p.name.startswith("__")))


def raw_copy(sources: list[Path], dst: Path) -> int:
    """Read all sources, write the bytes to `dst`, fsync. Returns bytes moved."""
    total = 0
    with open(dst, "wb") as out:
        for src in sources:
            with open(src, "rb") as f:
                while chunk := f.read(CHUNK):
                    out.write(chunk)
                    total += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    return total


def _run(fn: Callable[[Path], object], out: Path) -> float:
    """Time one run writing a fresh `out`; removing the previous result and flushing pending writeback
    (os.sync) happen before the clock starts, so every run meets an idle disk."""
    if out.is_file():
        out.unlink()
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    t0 = time.perf_counter()
    fn(out)
    return time.perf_counter() - t0


def interleaved(conv: Callable[[Path], object], conv_out: Path, raw: Callable[[Path], object], raw_out: Path,
                repeats: int) -> tuple[list[float], list[float]]:
    """Alternate conversion and raw runs so both see the same machine load (the box may be shared)."""
    c, r = [], []
    for _ in range(repeats):
        c.append(_run(conv, conv_out))
        r.append(_run(raw, raw_out))
    return c, r


def report(label: str, nbytes: int, conv: list[float], raw: list[float]) -> None:
    c, r = statistics.median(conv), statistics.median(raw)
    gb = nbytes / 1e9
    print(f"{label:12s} bytes={gb:.3f}GB  convert={c:.2f}s ({gb / c:.3f} GB/s)  raw read+write={r:.2f}s "
          f"({gb / r:.3f} GB/s)  ratio={r / c:.2f}  [median of {len(conv)}; convert runs {', '.join(f'{t:.2f}' for t in conv)}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", default=None, help="HF folder (default: SmolLM2-135M-Instruct fp32)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workdir", default=None, help="where outputs go (default: a temp dir in /tmp)")
    a = ap.parse_args()

    from mcore_rl.convert import hf_to_mcore, mcore_to_hf

    if a.hf is None:
        from mcore_rl.models.smollm2 import materialize_smollm2

        a.hf = materialize_smollm2()
    hf = Path(a.hf)
    work = Path(tempfile.mkdtemp(prefix="mcore-rl-bench-convert-", dir=a.workdir))
    try:
        src_files = files_of(hf, (".safetensors",))
        nbytes = sum(p.stat().st_size for p in src_files)
        ckpt, back = work / "ckpt", work / "back"

        t0 = time.perf_counter()
        hf_to_mcore(hf, ckpt, a.tp, a.pp, force=True, progress=False)  # warm-up: imports, page cache
        first = time.perf_counter() - t0
        conv, raw = interleaved(lambda out: hf_to_mcore(hf, out, a.tp, a.pp, progress=False), ckpt,
                                lambda out: raw_copy(src_files, out), work / "raw.bin", a.repeats)
        print(f"model={hf.name} tp={a.tp} pp={a.pp} workdir={work} cpus={os.cpu_count()}")
        print(f"hf-to-mcore first run (with imports/process start) {first:.2f}s")
        report("hf-to-mcore", nbytes, conv, raw)

        ck_files = files_of(ckpt, (".distcp",))
        mcore_to_hf(ckpt, back, force=True, progress=False)  # warm-up
        conv, raw = interleaved(lambda out: mcore_to_hf(ckpt, out, progress=False), back,
                                lambda out: raw_copy(ck_files, out), work / "raw.bin", a.repeats)
        report("mcore-to-hf", sum(p.stat().st_size for p in ck_files), conv, raw)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
