"""mcore-rl against TRL's GRPOTrainer on the identical RL workload, one after the other in one invocation.

    python benchmarks/peer_trl.py [--steps 3] [--cache ~/.cache/mcore_rl] [--only mcore,trl-fp32,trl-bf16]

Workload: SmolLM2-135M-Instruct, 8 prompts x 4 samples per step, <= 48 new tokens, T=0.7, "What is a + b?".
TRL runs in its own virtual environment, created under --cache on first use with pinned versions
(PINNED below; `--system-site-packages`, so pins already satisfied system-wide are reused, not downloaded again).
Each trainer runs in its own process (peak RSS is per process): mcore-rl through benchmarks/e2e_step.py in its
default dtype (`model.dtype=auto`) and in fp32, TRL through benchmarks/trl_grpo_worker.py in fp32 and with
`bf16=True, use_cpu=True`. Prints one table (median s/step after the first step, generate / train split, peak
RSS), the ratios, and the load average before and after: on a shared machine, compare only numbers from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

PINNED = ["torch==2.13.0", "trl==1.16.0", "transformers==5.23.0", "accelerate==1.15.0", "datasets==5.2.0",
          "math-verify"]
HERE = Path(__file__).resolve().parent


def ensure_trl_venv(cache: Path) -> Path:
    """The venv's python, creating and installing the pinned TRL stack on first use (marker file = done)."""
    root = cache / "trl-venv"
    py = root / "bin" / "python"
    marker = root / ".pinned"
    if marker.is_file() and marker.read_text() == " ".join(PINNED) and py.is_file():
        return py
    print(f"creating TRL venv at {root} ({' '.join(PINNED)}) ...", flush=True)
    venv.EnvBuilder(system_site_packages=True, with_pip=True, clear=True).create(root)
    subprocess.run([str(py), "-m", "pip", "install", "-q", *PINNED], check=True)
    marker.write_text(" ".join(PINNED))
    return py


def _result(proc: subprocess.CompletedProcess, prefix: str) -> dict:
    """The JSON after `prefix` on the last such stdout line; otherwise the process's output tail, in the error."""
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(prefix):
            return json.loads(line[len(prefix):])
    raise RuntimeError(f"{proc.args[1]} exited {proc.returncode} without a result: {proc.stderr[-3000:]}")


def run_mcore(steps: int, *overrides: str) -> dict:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(HERE / "e2e_step.py"), "--steps", str(steps + 1), *overrides],
                          capture_output=True, text=True, env=env)
    r = _result(proc, "RESULT ")
    r["trainer"] = f"mcore-rl {r['dtype']}" + (" (auto)" if not overrides else "")
    return r


def run_trl(py: Path, model: Path, steps: int, precision: str) -> dict:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)  # TRL's venv must not see a worktree's packages
    proc = subprocess.run([str(py), str(HERE / "trl_grpo_worker.py"), "--model", str(model), "--steps",
                           str(steps + 1), "--precision", precision], capture_output=True, text=True, env=env)
    return _result(proc, "TRL_RESULT ")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3, help="measured steps per trainer (one warm-up step more)")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "mcore_rl")
    ap.add_argument("--only", default="mcore,mcore-fp32,trl-fp32,trl-bf16")
    a = ap.parse_args()
    from mcore_rl.models.smollm2 import materialize_smollm2

    model = materialize_smollm2()
    which = a.only.split(",")
    load0 = os.getloadavg()
    rows: list[dict] = []

    def done(r: dict) -> None:
        rows.append(r)
        print(f"finished {r['trainer']}: {json.dumps(r)} (load {os.getloadavg()[0]:.2f})", flush=True)

    if "mcore" in which:
        done(run_mcore(a.steps))
    if "mcore-fp32" in which:
        done(run_mcore(a.steps, "model.dtype=fp32"))
    if any(w.startswith("trl") for w in which):
        py = ensure_trl_venv(a.cache)
        for prec in ("bf16", "fp32"):
            if f"trl-{prec}" in which:
                done(run_trl(py, model, a.steps, prec))
    load1 = os.getloadavg()
    print(f"\nworkload: SmolLM2-135M-Instruct, 8 prompts x 4 samples, <= 48 new tokens, T=0.7; "
          f"{a.steps} measured steps each (after 1 warm-up), one after the other")
    print(f"load average (1/5/15 min) before: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, "
          f"after: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} on {os.cpu_count()} CPUs")
    print(f"| {'trainer':<28} | median s/step | generate | train | peak RSS |")
    print(f"|{'-' * 30}|---------------|----------|-------|----------|")
    for r in rows:
        print(f"| {r['trainer']:<28} | {r['step']:13.1f} | {r['generate']:8.1f} | {r['train']:5.1f} | "
              f"{r['peak_rss_gb']:5.2f} GB |")
    ours = [r for r in rows if r["trainer"].startswith("mcore-rl")]
    peers = [r for r in rows if r["trainer"].startswith("TRL")]
    for o in ours:
        for p in peers:
            print(f"{o['trainer']} vs {p['trainer']}: step time ratio {p['step'] / o['step']:.2f}x faster (goal >= 2 "
                  f"against TRL in its faster dtype), peak RSS {o['peak_rss_gb']:.2f} vs {p['peak_rss_gb']:.2f} GB")
    for o in ours:
        if "mismatch" in o:
            print(f"{o['trainer']}: train/rollout |logp diff| median {o['mismatch']:.4f}")


if __name__ == "__main__":
    main()
