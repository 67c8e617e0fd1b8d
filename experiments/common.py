"""Shared by the experiment scripts: run one arm through the real `mcore-rl-train` CLI, record what the machine was
doing meanwhile, and read the run's eval records back.

Why a wrapper around the CLI and not the trainer's Python API: the experiments must show what a user gets from the
command line, with the same overrides they would type. Each arm runs in its own process, one after another (never
concurrently: on a 2-core machine two arms would slow each other and the wall-clock comparison would be meaningless).

Every arm's run directory lives outside the repository (`MCORE_RL_EXP_ROOT`, default /work/exp_runs); only its eval
records (small jsonl) and selected training metrics are copied into `experiments/<name>/data/`, so `results.md` can
be regenerated from committed files (`--report-only`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

EXP_ROOT = Path(os.environ.get("MCORE_RL_EXP_ROOT", "/work/exp_runs"))

# The shrunk main job every arm shares: 4 prompts x 4 samples per update, a+b answers are short (32 new tokens),
# a 32-prompt held-out set sampled 4 times (mean@4). No HF export, no mid-run checkpoints, no TensorBoard/plots:
# they cost wall-clock that is not training.
BASE_OVERRIDES = [
    "seed=1234",
    "trainer.prompts_per_update=4",
    "trainer.samples_per_prompt=4",
    "trainer.max_new_tokens=32",
    "trainer.save_every=0",
    "trainer.keep_checkpoints=1",
    "trainer.export_hf=false",
    "eval.num_prompts=32",
    "eval.samples_per_prompt=4",
    "eval.max_new_tokens=32",
    "logging.tensorboard=false",
    "logging.plot=false",
    "logging.progress=false",
    "model.load_check.enabled=false",
]


@dataclass
class Arm:
    name: str
    label: str
    overrides: list[str]
    steps: int
    extra: dict = field(default_factory=dict)

    def command(self, run_dir: Path, steps: int | None = None) -> list[str]:
        return ["mcore-rl-train", f"hydra.run.dir={run_dir}", *BASE_OVERRIDES, *self.overrides,
                f"trainer.steps={steps or self.steps}"]


def _sample_load(stop: threading.Event, out: list[float], every: float = 10.0) -> None:
    while not stop.is_set():
        out.append(os.getloadavg()[0])
        stop.wait(every)


def run_arm(exp: str, arm: Arm, steps: int | None = None) -> Path:
    """Run (or continue: the trainer resumes from the run dir's checkpoint) `arm` up to `steps` updates. A segment
    already done is skipped. Each segment's wall-clock, the child's CPU-seconds (os.wait4 rusage: the trainer and
    every process it waited for) and the 1-minute load average sampled every 10 s go to run_dir/arm.json."""
    steps = steps or arm.steps
    run_dir = EXP_ROOT / exp / arm.name
    run_dir.mkdir(parents=True, exist_ok=True)
    meta_path = run_dir / "arm.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"segments": []}
    if any(s["steps"] >= steps and s["rc"] == 0 for s in meta["segments"]):
        print(f"[{exp}/{arm.name}] done already ({steps} updates), skipping", flush=True)
        return run_dir
    cmd = arm.command(run_dir, steps)
    print(f"[{exp}/{arm.name}] {time.strftime('%H:%M:%S')} start: {' '.join(cmd)}", flush=True)
    loads: list[float] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_load, args=(stop, loads), daemon=True)
    t0 = time.time()
    with open(run_dir / f"train_{steps}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    stop.set()
    sampler.join()
    seg = {"steps": steps, "rc": proc.returncode, "wall_s": time.time() - t0, "cpu_user_s": usage.ru_utime,
           "cpu_sys_s": usage.ru_stime, "load_mean": sum(loads) / max(len(loads), 1),
           "load_max": max(loads, default=float("nan")), "load_samples": len(loads), "started": t0,
           "command": cmd}
    meta["segments"].append(seg)
    meta_path.write_text(json.dumps(meta, indent=1))
    print(f"[{exp}/{arm.name}] {time.strftime('%H:%M:%S')} rc={proc.returncode} wall={seg['wall_s']:.0f}s "
          f"cpu={seg['cpu_user_s'] + seg['cpu_sys_s']:.0f}s load={seg['load_mean']:.1f}", flush=True)
    if proc.returncode != 0:
        print(f"[{exp}/{arm.name}] FAILED, see {run_dir}/train_{steps}.log", file=sys.stderr, flush=True)
    return run_dir


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def collect(exp_dir: Path, exp: str, arm: Arm, train_keys: tuple[str, ...] = ()) -> None:
    """Copy the arm's eval records, arm.json and the chosen per-update training metrics into the repository."""
    run_dir = EXP_ROOT / exp / arm.name
    data = exp_dir / "data"
    data.mkdir(exist_ok=True)
    if (run_dir / "eval.jsonl").exists():
        shutil.copyfile(run_dir / "eval.jsonl", data / f"{arm.name}.eval.jsonl")
    if (run_dir / "arm.json").exists():
        shutil.copyfile(run_dir / "arm.json", data / f"{arm.name}.arm.json")
    if train_keys and (run_dir / "metrics.jsonl").exists():
        rows = [{k: r[k] for k in ("step", *train_keys) if k in r} for r in read_jsonl(run_dir / "metrics.jsonl")]
        (data / f"{arm.name}.train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def evals(exp_dir: Path, arm: Arm) -> list[dict]:
    return read_jsonl(exp_dir / "data" / f"{arm.name}.eval.jsonl")


def arm_meta(exp_dir: Path, arm: Arm) -> dict:
    p = exp_dir / "data" / f"{arm.name}.arm.json"
    return json.loads(p.read_text()) if p.exists() else {"segments": []}


def first_reaching(records: list[dict], target: float, metric: str = "mean_at_k") -> dict | None:
    """The first eval record at or above `target` (None: the arm never reached it)."""
    for r in records:
        if r.get(metric, float("-inf")) >= target - 1e-12:
            return r
    return None


def fmt(x, spec: str = ".3f", none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


@contextmanager
def figure_panels(out: Path, **subplots_kw) -> Iterator:
    """matplotlib axes (headless Agg backend) of a 1x2 figure; the figure is laid out, saved to `out` and closed
    when the block ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), dpi=80, **subplots_kw)
    try:
        yield axes
        fig.tight_layout()
        fig.savefig(out)
    finally:
        plt.close(fig)


def write_results(exp_dir: Path, lines: list[str]) -> None:
    """The report: experiments/<name>/results.md, echoed to stdout."""
    (exp_dir / "results.md").write_text("\n".join(lines))
    print("\n".join(lines))


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return "?"


def arms_main(doc: str, exp_dir: Path, exp: str, arms: list[Arm], train_keys: tuple[str, ...],
              report) -> None:
    """The CLI every arms experiment shares: run (a subset of) its arms sequentially, then write the report."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report-only", action="store_true", help="rebuild results.md/PNG from data/ only")
    ap.add_argument("--arms", nargs="*", default=None, help="run only these arms (names)")
    args = ap.parse_args()
    if not args.report_only:
        for arm in arms:
            if args.arms is None or arm.name in args.arms:
                run_arm(exp, arm)
                collect(exp_dir, exp, arm, train_keys)
    report()
