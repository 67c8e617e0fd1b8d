"""GRPO (mu=4 updates per rollout) vs Mu-GRPO (one large stage) at the same number of optimizer updates.

    python benchmarks/mu_grpo_wallclock.py [--updates 8] [--model tiny] [extra Hydra overrides...]

Both runs use the same model, prompts per update, group size and token limits; only the schedule differs. Prints each
run's training-loop wall-clock (setup excluded), the ratio, and the time spent in weight sync and engine switching (release/resume), which is what
Mu-GRPO's few large stages save, next to generation and training time.
"""

from __future__ import annotations

import argparse
import json
import time

from scratch import scratch_dir  # benchmarks/scratch.py (sys.path[0] is this folder)

PHASES = ("time_generate", "time_reward", "time_old_logp", "time_train", "time_sync", "time_switch")


def run(name: str, overrides: list[str]) -> tuple[float, dict[str, float]]:
    from hydra import compose, initialize_config_dir

    from mcore_rl.config import load_config
    from mcore_rl.train import CONFIG_DIR
    from mcore_rl.trainer.build import build
    from mcore_rl.trainer.loop import train

    run_dir = scratch_dir(f"mu_bench_{name}_")
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = load_config(compose(config_name="config", overrides=[*overrides, f"run.dir={run_dir}"]))
    components, state = build(cfg)  # model build and weight load are outside the timed loop
    t0 = time.perf_counter()
    train(components, state)
    wall = time.perf_counter() - t0
    from mcore_rl.distributed import destroy_distributed

    destroy_distributed()
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    totals = {k: sum(r.get(k, 0.0) for r in recs) for k in PHASES}
    totals["updates"] = float(len(recs))
    totals["syncs"] = float(sum(1 for r in recs if "sync_s" in r))
    return wall, totals


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--updates", type=int, default=8)
    ap.add_argument("--model", default="tiny")
    a, extra = ap.parse_known_args()
    common = [f"model={a.model}", f"trainer.steps={a.updates}", "trainer.prompts_per_update=4",
              "trainer.samples_per_prompt=4", "trainer.max_new_tokens=16", "eval.num_prompts=0",
              "trainer.save_every=0", "trainer.export_hf=false", "logging.progress=false", "logging.plot=false",
              *extra]
    grpo = run("grpo", ["algorithm=grpo", "algorithm.updates_per_rollout=4", *common])
    mu = run("mu_grpo", ["algorithm=mu_grpo", f"algorithm.updates_per_stage={a.updates}", *common])
    print(f"{'':>10} {'wall s':>8} {'updates':>8} {'syncs':>6} " + " ".join(f"{k[5:]:>9}" for k in PHASES))
    for name, (wall, t) in (("grpo", grpo), ("mu_grpo", mu)):
        print(f"{name:>10} {wall:8.1f} {t['updates']:8.0f} {t['syncs']:6.0f} "
              + " ".join(f"{t[k]:9.2f}" for k in PHASES))
    print(f"wall-clock ratio grpo/mu_grpo: {grpo[0] / mu[0]:.2f}")
    sw = lambda t: t["time_sync"] + t["time_switch"]  # noqa: E731
    print(f"sync+switch: grpo {sw(grpo[1]):.2f} s vs mu_grpo {sw(mu[1]):.2f} s")


if __name__ == "__main__":
    main()
