"""Old-log-prob sources side by side: SmolLM2-135M, async PipelineRL-k (k=2), the same run once per source.

Usage: python benchmarks/old_logits.py [--updates 8] [--prompts 2] [--samples 2] [--max-new-tokens 32]
                                        [--audit-frac 0.25] [--dtype fp32|bf16] [--sources rollout,recompute,...] [--workdir DIR]

Per source: seconds per update (steady state: wall-clock between the first and the last update's metrics
records, over the updates between them), the source's extra memory (host weight copies for snapshot /
interrupt, the forward-only model for old_logit_model; the audit's own copies for rollout / recompute are
measurement overhead and are NOT counted), and the missing-old-logit error: mean |old_logp - exact| over the
audited rows (exact = each token scored under the weights of the version that generated it), averaged over the
updates. Each source is one `mcore-rl-train` process with the same seed and data; async generation timing
differs between runs, so which tokens are stale differs too (the stale-token fraction is printed alongside).
The audit (--audit-frac of each round's rows, one forward per stale version) adds the same cost to every source.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from scratch import scratch_dir  # benchmarks/scratch.py (sys.path[0] is this folder)

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("rollout", "recompute", "snapshot", "old_logit_model", "interrupt")


def run_source(src: str, a: argparse.Namespace, root: Path) -> dict:
    run_dir = root / src
    cmd = [sys.executable, "-m", "mcore_rl.train", "model=smollm2", f"run.dir={run_dir}",
           "algorithm=grpo", "algorithm.schedule=async", f"algorithm.max_staleness={a.k}",
           f"algorithm.old_logp_source={src}", f"algorithm.old_logp_audit_frac={a.audit_frac}",
           "algorithm.updates_per_rollout=1", "algorithm.kl_coef=0.0", f"optim.lr={a.lr}",
           f"trainer.steps={a.updates}", f"trainer.prompts_per_update={a.prompts}",
           f"trainer.samples_per_prompt={a.samples}", f"trainer.max_new_tokens={a.max_new_tokens}",
           "trainer.save_every=0", "trainer.export_hf=false", "eval.num_prompts=0", "logging.plot=false",
           "logging.progress=false", "logging.tensorboard=false", "model.load_check.enabled=false",
           f"model.dtype={a.dtype}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{src}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    times = [r["time"] for r in recs]
    per_update = (times[-1] - times[0]) / max(1, len(times) - 1)
    errs = [r["old_logp_error"] for r in recs if "old_logp_error" in r]
    stale = [r["old_logp_stale_token_frac"] for r in recs if "old_logp_stale_token_frac" in r]
    last = recs[-1]
    extra = last.get("old_logp_snapshot_gb", 0.0) + last.get("old_logit_model_gb", 0.0)
    return {"source": src, "s_per_update": per_update, "extra_gb": extra,
            "copies": last.get("old_logp_snapshots", 1.0 if "old_logit_model_gb" in last else 0.0),
            "error": sum(errs) / max(1, len(errs)), "error_max": max((r.get("old_logp_error_max", 0.0)
                                                                       for r in recs), default=0.0),
            "stale_frac": sum(stale) / max(1, len(stale)),
            "regenerated": last.get("old_logp_regenerated_samples", 0.0), "wall_s": wall,
            "peak_rss_gb": max(r.get("mem_peak_gb", 0.0) for r in recs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--updates", type=int, default=8)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per update")
    ap.add_argument("--samples", type=int, default=2, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--audit-frac", type=float, default=0.25)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--dtype", default="fp32", help="fp32: the audit's noise floor is ~1e-6; in bf16 scoring a "
                    "row subset (the audit) vs the whole batch alone differs by ~1e-3 (batch-shape rounding)")
    ap.add_argument("--sources", default=",".join(SOURCES))
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args()
    root = Path(a.workdir) if a.workdir else scratch_dir("old_logits_")
    rows = [run_source(s, a, root) for s in a.sources.split(",")]
    print(f"SmolLM2-135M {a.dtype}, async k={a.k}, {a.updates} updates, {a.prompts} prompts x {a.samples} samples, "
          f"{a.max_new_tokens} new tokens, audit on {a.audit_frac:.0%} of rows")
    head = (f"{'source':<16} {'s/update':>9} {'extra GB':>9} {'copies':>6} {'old-logit err':>13} "
            f"{'err max':>9} {'stale tok':>9} {'regen':>6} {'peak RSS GB':>11}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['source']:<16} {r['s_per_update']:>9.2f} {r['extra_gb']:>9.3f} {r['copies']:>6.0f} "
              f"{r['error']:>13.2e} {r['error_max']:>9.2e} {r['stale_frac']:>9.2f} {r['regenerated']:>6.0f} "
              f"{r['peak_rss_gb']:>11.2f}")
    base = next((r for r in rows if r["source"] == "recompute"), None)
    if base:
        print("time ratio vs recompute: " + ", ".join(f"{r['source']} {r['s_per_update'] / base['s_per_update']:.2f}x"
                                                     for r in rows))


if __name__ == "__main__":
    main()
