"""Shared by the experiment scripts: run one (arm, seed) through the real `mcore-rl-train` CLI (skipped, resumed or
started as plan.py decides), record what the machine was doing meanwhile, and read the runs' records back.

Why a wrapper around the CLI and not the trainer's Python API: the experiments must show what a user gets from the
command line, with the same overrides they would type. Each arm runs in its own process, one after another (never
concurrently: on a 2-core machine two arms would slow each other and the wall-clock comparison would be meaningless).

Every run directory lives outside the repository (`MCORE_RL_EXP_ROOT`, default /work/exp_runs, then
<exp>/<arm>/seed<N>); only its eval records (small jsonl, per-prompt correctness merged in), arm.json, the DONE
marker and selected training metrics are copied into `experiments/<name>/data/<arm>/seed<N>.*`, so `results.md` can
be regenerated from committed files (`--report-only`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from deadline import estimate_s, fits, parse_until
from plan import MARKER as DONE
from plan import decide, drop_checkpoints, probe, set_aside, write_marker

EXP_ROOT = Path(os.environ.get("MCORE_RL_EXP_ROOT", "/work/exp_runs"))
# the trainer phases whose per-update seconds every arm keeps (where the time goes)
PHASES = ("time_generate", "time_reward", "time_old_logp", "time_train", "time_sync", "time_switch")
SEED_BASE = 1234  # seeds are SEED_BASE, SEED_BASE + 1, ... (`--seeds N` takes the first N)

# The task every arm trains on (experiments/README.md: why, and its measured base rate): a data yaml from
# hydra_conf/data/ and the response budget its answers need. The held-out split is the trainer's default (the same
# yaml with seed + 1000), which the yaml's `exclude` keeps disjoint from training (tests/data/test_exp_tasks.py).
TASK_OVERRIDES = [
    "data=addsub",
    "trainer.max_new_tokens=48",  # answers are ~20 tokens; the base model rambles past 48 in ~14% of them
    "eval.max_new_tokens=48",
    "eval.num_prompts=32",  # 32 x 4 answers: ~30 s per eval on this machine
    "eval.samples_per_prompt=4",
]
# The main job's batch and learning rate, which every arm shares: 16 prompts x 4 samples per update at lr 2e-5. Why
# not smaller: 4 or 8 prompts x 4 (lr 2e-5 / 5e-5) left 50-75% of groups without a success on the worked three-term
# sum and nothing learned (experiments/README.md). The dtype is the arm's (`Arm.dtype`), never `auto`: runs of one
# queue may land on different machines over several days and must compute the same thing.
# Checkpoints (one kept) so an interrupted arm resumes (trainer.resume=auto); no HF export, TensorBoard or plots:
# they cost wall-clock that is not training.
BASE_OVERRIDES = [
    *TASK_OVERRIDES,
    "trainer.prompts_per_update=16",
    "trainer.samples_per_prompt=4",
    "trainer.resume=auto",
    "trainer.keep_checkpoints=1",
    "trainer.export_hf=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "logging.progress=false",
    "model.load_check.enabled=false",
    # every arm trains every row, as the runs already in data/ did: skipping zero-gradient rows (GRPO-family arms
    # only) is the same update but would make those arms' wall-clock incomparable with the rest
    "trainer.skip_inert_rows=false",
    # and every arm with the recompute anchor runs its scoring forward, as those in data/ did (one update per round
    # could take it from the update's own forward: same update, less wall-clock)
    "trainer.reuse_old_logp=false",
]


@dataclass
class Arm:
    name: str
    label: str
    overrides: list[str]
    steps: int
    save_every: int = 4  # checkpoint cadence: how much an interruption can cost (each save is ~1 s at 135M)
    extra: dict = field(default_factory=dict)
    max_seeds: int | None = None  # a measurement run (e.g. an audit), not a comparison: the first N seeds only
    # model.dtype of every seed. bf16 by default: what GPU users train in, and its train-inference mismatch is what
    # the Train-Infer Mask and the exact old-logit sources exist for. On a CPU without bf16 matrix hardware the
    # trainer runs the same bf16 products through fp32 GEMMs (`model.bf16_matmul=auto`, compat/bf16_matmul.py).
    dtype: str = "bf16"

    def command(self, run_dir: Path, seed: int, steps: int | None = None) -> list[str]:
        return ["mcore-rl-train", f"hydra.run.dir={run_dir}", *BASE_OVERRIDES, f"model.dtype={self.dtype}",
                f"seed={seed}", f"trainer.save_every={self.save_every}", *self.overrides,
                f"trainer.steps={steps or self.steps}"]


def seeds_for(n: int) -> list[int]:
    if n < 1:
        raise SystemExit(f"--seeds: need at least 1, got {n}")
    return [SEED_BASE + i for i in range(n)]


def run_dir_for(exp: str, arm: Arm, seed: int) -> Path:
    return EXP_ROOT / exp / arm.name / f"seed{seed}"


def _sample_load(stop: threading.Event, out: list[float], every: float = 10.0) -> None:
    while not stop.is_set():
        out.append(os.getloadavg()[0])
        stop.wait(every)


TRAINS = ("start", "resume", "restart")  # the plan actions that launch a trainer (skip and finish do not)
STOPPED_EXIT = 75  # an experiment's exit code after a stop request: queue.sh stops too (rerun it to resume)
_STOP = threading.Event()
_CHILD: list[subprocess.Popen] = []  # the trainer process of the segment running now, if any


def _request_stop(signum: int, frame) -> None:
    """SIGTERM / SIGINT: the running trainer gets SIGTERM (it checkpoints at its next round boundary and exits),
    its segment is still recorded (wall-clock, CPU-seconds), and no further run starts."""
    _STOP.set()
    for proc in _CHILD:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)


def install_stop_handler() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _request_stop)


def stop_file() -> Path:
    """`queue.sh --stop` creates it: a request that also reaches a queue between two runs (no trainer to signal)."""
    return EXP_ROOT / "STOP"


def stop_requested() -> bool:
    return _STOP.is_set() or stop_file().exists()


def _segment(run_dir: Path, cmd: list[str], log_name: str) -> dict:
    """One trainer process: its wall-clock, CPU-seconds (os.wait4 rusage: the trainer and every process it waited
    for) and the 1-minute load average sampled every 10 s."""
    loads: list[float] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_load, args=(stop, loads), daemon=True)
    t0 = time.time()
    with open(run_dir / log_name, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        _CHILD.append(proc)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)  # a stop request's handler runs meanwhile; the wait goes on
        _CHILD.remove(proc)
        rc = os.waitstatus_to_exitcode(status)
    stop.set()
    sampler.join()
    return {"rc": rc, "wall_s": time.time() - t0, "cpu_user_s": usage.ru_utime, "cpu_sys_s": usage.ru_stime,
            "load_mean": sum(loads) / max(len(loads), 1), "load_max": max(loads, default=float("nan")),
            "load_samples": len(loads), "started": t0, "command": cmd, **machine(),
            **bf16_route(run_dir / log_name)}


BF16_ROUTE_LINE = "bf16 matmuls: "  # what precision.configure_bf16_matmul logs when a bf16 model runs on CPU


def bf16_route(log_path: Path) -> dict:
    """{"bf16_matmul": "fp32 GEMM" | "native"} from a trainer log (compat/bf16_matmul.py: which kernels computed
    the bf16 products), {} when the log has no such line (an fp32 run, a GPU run, or a trainer that predates it)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return {}
    for line in text.splitlines():
        if BF16_ROUTE_LINE in line:
            return {"bf16_matmul": "fp32 GEMM" if "fp32 GEMM" in line else "native"}
    return {}


def machine() -> dict:
    """What the numbers were measured on: CPU model, cores, and the host name (the load is per segment)."""
    model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu_model": model, "cpu_count": os.cpu_count(), "host": os.uname().nodename,
            "code": os.environ.get("MCORE_RL_EXP_CODE", "?")}  # the commit the trainer ran (queue.sh sets it)


def committed_marker(exp_dir: Path, arm: Arm, seed: int) -> Path:
    """Where collect() copies a finished run's DONE marker: in git, so it outlives the run directory."""
    return exp_dir / "data" / arm.name / f"seed{seed}.{DONE}"


def run_arm(exp: str, arm: Arm, seed: int, steps: int | None = None, exp_dir: Path | None = None) -> Path:
    """Bring one (arm, seed) run to `steps` updates, as plan.decide says: skip a finished one (its own marker, or
    the committed copy under `exp_dir`/data), write a missing marker, resume from the checkpoint, or (re)start. The
    DONE marker is written atomically after the last eval."""
    steps = steps or arm.steps
    run_dir = run_dir_for(exp, arm, seed)
    committed = committed_marker(exp_dir, arm, seed) if exp_dir is not None else None
    action, reason = decide(probe(run_dir, committed), steps)
    tag = f"[{exp}/{arm.name}/seed{seed}]"
    print(f"{tag} {action}: {reason}", flush=True)
    if action == "skip" or (action != "finish" and stop_requested()):
        return run_dir
    if action == "restart":
        print(f"{tag} leftovers moved to {set_aside(run_dir)}", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    meta_path = run_dir / "arm.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"segments": []}
    if action != "finish":
        cmd = arm.command(run_dir, seed, steps)
        print(f"{tag} {time.strftime('%H:%M:%S')} {action}: {' '.join(cmd)}", flush=True)
        seg = {"steps": steps, "action": action, **_segment(run_dir, cmd, f"train_{len(meta['segments'])}.log")}
        meta["segments"].append(seg)
        meta_path.write_text(json.dumps(meta, indent=1))
        print(f"{tag} {time.strftime('%H:%M:%S')} rc={seg['rc']} wall={seg['wall_s']:.0f}s "
              f"cpu={seg['cpu_user_s'] + seg['cpu_sys_s']:.0f}s load={seg['load_mean']:.1f}", flush=True)
    state = probe(run_dir)
    if state.last_rc == 0 and state.last_eval_step is not None and state.last_eval_step >= steps:
        write_marker(run_dir, {"steps": steps, "seed": seed, "arm": arm.name, "finished": time.time()})
        drop_checkpoints(run_dir)
    else:
        print(f"{tag} NOT finished (rc={state.last_rc}, last eval at {state.last_eval_step}); see {run_dir}",
              file=sys.stderr, flush=True)
    return run_dir


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_per_step(records: list[dict]) -> list[dict]:
    """A resumed run re-evaluates the updates after its checkpoint: the later record of a step wins."""
    return sorted({r["step"]: r for r in records}.values(), key=lambda r: r["step"])


def collect(exp_dir: Path, exp: str, arm: Arm, seed: int, train_keys: tuple[str, ...] = ()) -> None:
    """Copy one run's eval records (per-prompt correctness merged in), arm.json and the chosen per-update training
    metrics into experiments/<exp>/data/<arm>/seed<N>.*"""
    run_dir = run_dir_for(exp, arm, seed)
    data = exp_dir / "data" / arm.name
    if not (run_dir / "eval.jsonl").exists():
        return
    data.mkdir(parents=True, exist_ok=True)
    per_prompt = {r["step"]: r.get("per_prompt_correct") for r in read_jsonl(run_dir / "eval_prompts.jsonl")}
    recs = [{**r, "correct": per_prompt[r["step"]]} if per_prompt.get(r["step"]) else r
            for r in last_per_step(read_jsonl(run_dir / "eval.jsonl"))]
    (data / f"seed{seed}.eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    for name in ("arm.json", DONE):
        if (run_dir / name).exists():
            shutil.copyfile(run_dir / name, data / f"seed{seed}.{name}")
    if (run_dir / "metrics.jsonl").exists():
        rows = [{k: r[k] for k in ("step", *train_keys, *PHASES) if k in r}
                for r in last_per_step(read_jsonl(run_dir / "metrics.jsonl"))]
        (data / f"seed{seed}.train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def evals(exp_dir: Path, arm: Arm) -> dict[int, list[dict]]:
    """{seed: eval records} from the committed data/ (only finished runs: a DONE marker copy)."""
    out = {}
    for f in sorted((exp_dir / "data" / arm.name).glob("seed*.eval.jsonl")):
        seed = int(f.name.split(".")[0][4:])
        if committed_marker(exp_dir, arm, seed).exists():
            out[seed] = read_jsonl(f)
    return out


def arm_meta(exp_dir: Path, arm: Arm) -> dict[int, dict]:
    out = {}
    for f in sorted((exp_dir / "data" / arm.name).glob("seed*.arm.json")):
        out[int(f.name.split(".")[0][4:])] = json.loads(f.read_text())
    return out


def train_records(exp_dir: Path, arm: Arm) -> dict[int, list[dict]]:
    out = {}
    for f in sorted((exp_dir / "data" / arm.name).glob("seed*.train.jsonl")):
        out[int(f.name.split(".")[0][4:])] = read_jsonl(f)
    return out


def fmt(x, spec: str = ".3f", none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


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


# The GPU profile of every experiment: the same arms on a 0.5B-1.5B instruct model with SGLang rollout, colocated
# on one GPU (the servers release memory while the trainer runs). `--gpu MODEL_DIR` appends these after the arm's own
# overrides; run directories go to <exp>_gpu/. The task is harder (3-5 terms of 1-2 digits): a 0.5B model would
# saturate the CPU task; measure its base rate first (experiments/README.md).
GPU_OVERRIDES = [
    "model=hf",
    "rollout=sglang",
    "rollout.launcher.colocate=true",
    "data.options.min_terms=3",
    "data.options.max_terms=5",
    "data.options.max_digits=2",
    "data.options.operators=[+,-]",
    "trainer.prompts_per_update=32",
    "trainer.samples_per_prompt=8",
    "trainer.max_new_tokens=512",
    "trainer.token_budget=16384",
    "eval.max_new_tokens=512",
    "eval.num_prompts=256",
    "eval.samples_per_prompt=4",
]


def gpu_arm(arm: Arm, model_dir: str) -> Arm:
    """The arm with the GPU profile (its own overrides first, so the profile's batch sizes win; the model last)."""
    return replace(arm, overrides=[*arm.overrides, *GPU_OVERRIDES, f"model.hf_path={model_dir}"], dtype="bf16")


def arms_main(doc: str, exp_dir: Path, exp: str, arms: list[Arm], train_keys: tuple[str, ...],
              report, headline: tuple[str, ...] = ()) -> None:
    """The CLI every arms experiment shares: every (seed, arm) run in queue order (plan.plan: seeds outer), each
    skipped, resumed or started from what its run directory holds, then the report from data/. `headline`: the
    arms the claim itself compares (`--headline` runs only those: a verdict before the ablations)."""
    import argparse

    from plan import plan

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report-only", action="store_true", help="rebuild results.md/PNG from data/ only")
    ap.add_argument("--arms", nargs="*", default=None, help="run only these arms (names)")
    ap.add_argument("--headline", action="store_true", help=f"run only the headline arms {list(headline)}")
    ap.add_argument("--seeds", type=int, default=3, help="training seeds per arm (1234, 1235, ...; default 3)")
    ap.add_argument("--dry-run", action="store_true", help="print what each (seed, arm) would do and stop")
    ap.add_argument("--gpu", metavar="MODEL_DIR", default=None,
                    help="the GPU profile (GPU_OVERRIDES) with this HF model folder; runs go to <exp>_gpu/")
    ap.add_argument("--until", metavar="HH:MM", default=None,
                    help="start no run expected to end after this time (UTC; deadline.py), then stop as --stop does")
    args = ap.parse_args()
    until = parse_until(args.until) if args.until else None
    install_stop_handler()
    unknown = sorted(set(args.arms or ()) - {a.name for a in arms})
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; known: {[a.name for a in arms]}")
    chosen = [a for a in arms if (args.arms is None or a.name in args.arms)
              and (not args.headline or a.name in headline)]
    if args.gpu:
        chosen, exp, exp_dir = [gpu_arm(a, args.gpu) for a in chosen], f"{exp}_gpu", exp_dir / "gpu"
    if not args.report_only:
        seeds = seeds_for(args.seeds)
        by_name = {a.name: a for a in chosen}
        states = {(a.name, s): probe(run_dir_for(exp, a, s), committed_marker(exp_dir, a, s))
                  for a in chosen for s in seeds}
        for job in plan([(a.name, a.steps) for a in chosen], seeds, states):
            cap = by_name[job.arm].max_seeds
            if cap is not None and job.seed not in seeds[:cap]:
                continue
            trains = job.action in TRAINS  # only a run that launches a trainer needs an estimate
            eta = estimate_s(exp_dir, job.arm, by_name[job.arm].steps, states[(job.arm, job.seed)]) if trains else None
            if args.dry_run:
                took = f", ~{eta / 60:.0f} min" if eta is not None else ""
                print(f"seed {job.seed} {job.arm}: {job.action} ({job.reason}{took})", flush=True)
                continue
            if stop_requested():
                break
            if trains and not fits(f"[{exp}/{job.arm}/seed{job.seed}]", eta, until):
                _STOP.set()
                break
            run_arm(exp, by_name[job.arm], job.seed, exp_dir=exp_dir)
            collect(exp_dir, exp, by_name[job.arm], job.seed, train_keys)
        if args.dry_run:
            return
    report(exp_dir)
    if stop_requested():
        print(f"{exp}: stopped on request; rerun the same command to resume", flush=True)
        sys.exit(STOPPED_EXIT)
