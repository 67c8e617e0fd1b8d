"""The old log-probs from the update's own forward (`trainer.reuse_old_logp`) against a separate scoring forward, side
by side in one invocation.

    python benchmarks/reuse_old_logp.py [--steps 3] [--repeats 2] [extra Hydra overrides...]

Workload: benchmarks/e2e_step.py's (SmolLM2-135M, 8 prompts x 4 samples, <= 48 new tokens, one update per round),
GRPO with the recompute anchor and no KL (what reuse applies to), in the default dtype. The two settings alternate
(`--repeats` pairs) so that a change of machine load falls on both. Prints the median step time and the trainer's
time per step (update + scoring forward) of each, their ratios, and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics

from peer_trl import run_mcore  # benchmarks/peer_trl.py (sys.path[0] is this folder)

WORKLOAD = ["algorithm=grpo", "algorithm.old_logp_source=recompute", "algorithm.kl_coef=0.0"]
SETTINGS = {"separate scoring forward": "trainer.reuse_old_logp=false",
            "reused from the update": "trainer.reuse_old_logp=true"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3, help="steps measured per run (after one warm-up step)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each setting, alternating")
    a, extra = ap.parse_known_args()
    load0 = os.getloadavg()[0]
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for i in range(a.repeats):
        for name, flag in SETTINGS.items():
            r = run_mcore(a.steps, *WORKLOAD, flag, *extra)
            results[name].append(r)
            print(f"[{i + 1}/{a.repeats}] {name}: step {r['step']:.2f} s, train+score {r['train']:.2f} s "
                  f"({r['dtype']})", flush=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("step", "train")} for name, rs in results.items()}
    print(f"\n{'setting':<26} {'s/step':>8} {'train+score s':>14}")
    for name, m in med.items():
        print(f"{name:<26} {m['step']:>8.2f} {m['train']:>14.2f}")
    sep, own = med["separate scoring forward"], med["reused from the update"]
    print(f"ratio reused / separate: step {own['step'] / sep['step']:.3f}, "
          f"train+score {own['train'] / sep['train']:.3f}")
    print(f"load average (1 min): {load0:.1f} before, {os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()
