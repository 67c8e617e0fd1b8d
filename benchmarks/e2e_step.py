"""One RL step of the default model, measured: 8 prompts x 4 samples, <= 48 new tokens, T=0.7.

    python benchmarks/e2e_step.py [--steps 4] [extra Hydra overrides...]

Runs the real trainer (SmolLM2-135M, GRPO, embedded engine) for a few on-policy steps and prints the median step time
with its phase split (generate / reward / old-logprob / train / sync) and the peak RSS of the process tree.
Trains in the default `model.dtype=auto` (bf16 where this CPU's bf16 matmul is >= 1.5x fp32); pass
`model.dtype=fp32` to compare. The last line, RESULT {...}, is for benchmarks/peer_trl.py.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
from pathlib import Path

from scratch import scratch_dir  # benchmarks/scratch.py (sys.path[0] is this folder)

PHASES = ("time_generate", "time_reward", "time_old_logp", "time_train", "time_sync")


def _dtype_of(run_dir: Path) -> str:
    """The dtype the run trained in, as the trainer recorded it (model.dtype=auto is resolved at start)."""
    from omegaconf import OmegaConf

    p = run_dir / "config.yaml"
    return str(OmegaConf.load(p).model.dtype) if p.is_file() else "?"


def main() -> None:
    from mcore_rl.compat.malloc import tune_malloc

    tune_malloc()  # before torch starts threads
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    a, extra = ap.parse_known_args()
    from hydra import compose, initialize_config_dir

    from mcore_rl.train import CONFIG_DIR, run_training

    run_dir = scratch_dir("e2e_step_")
    overrides = [f"trainer.steps={a.steps}", "trainer.prompts_per_update=8", "trainer.samples_per_prompt=4",
                 "trainer.max_new_tokens=48", "trainer.temperature=0.7", "algorithm.updates_per_rollout=1",
                 "eval.num_prompts=0", "trainer.save_every=0", "trainer.export_hf=false", "logging.progress=false",
                 f"run.dir={run_dir}", *extra]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    run_training(cfg)
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = recs[1:] if len(recs) > 1 else recs  # the first step pays one-time warm-up
    step_times = [sum(r.get(k, 0.0) for k in PHASES) for r in steady]
    peak_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    peak_children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6
    print(f"steps measured: {len(steady)} (of {len(recs)}); overrides: {' '.join(extra) or '-'}")
    print(f"median step time: {statistics.median(step_times):.1f} s")
    for k in PHASES:
        print(f"  {k.removeprefix('time_'):>10}: {statistics.median(r.get(k, 0.0) for r in steady):6.2f} s")
    print(f"  rollout tokens/step: {statistics.median(r['rollout_tokens'] for r in steady):.0f}")
    rss = ", ".join(f"{r.get('mem_rss_gb', 0.0):.2f}" for r in recs)
    print(f"peak RSS during the steps: {max(r.get('mem_peak_gb', 0.0) for r in recs):.2f} GB "
          f"(resident after each step: {rss})")
    print(f"peak RSS incl. final checkpoint + HF export: trainer {peak_self:.2f} GB, largest child {peak_children:.2f} GB")
    print("RESULT " + json.dumps({
        "steps": len(steady), "step": statistics.median(step_times),
        "generate": statistics.median(r.get("time_generate", 0.0) for r in steady),
        "train": statistics.median(r.get("time_train", 0.0) + r.get("time_old_logp", 0.0) for r in steady),
        "peak_rss_gb": max(peak_self, max(r.get("mem_peak_gb", 0.0) for r in recs)),
        "dtype": _dtype_of(run_dir), "mismatch": statistics.median(
            r.get("train_rollout_logprob_abs_diff", 0.0) for r in steady)}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
