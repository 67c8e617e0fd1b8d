"""The README's main job with full weights and with LoRA adapters, side by side: held-out curve, peak RSS, trainable
parameters, time per phase, and one PNG of both curves.

    python benchmarks/lora_main_job.py [--out DIR] [--rank 16] [--alpha 32] [--lora-lr 2e-4] [-- extra overrides]
    python benchmarks/lora_main_job.py --full RUN_DIR --lora RUN_DIR      # report two finished runs

Both runs are the main job (SmolLM2-135M-Instruct, a+b, GRPO, 16 prompts x 4 samples, 20 updates, same seed and
prompts); the LoRA run adds `model.lora.rank/alpha` on every linear and a 10x learning rate (adapters start at
zero and move through a rank-R product, so the full-weight rate barely moves them: the usual LoRA practice).
Peak RSS is the run's own high-water mark (`mem_peak_gb` in metrics.jsonl), trainable parameters are counted from
what the run saved (the adapters file, or the exported HF model for full weights).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def saved_params(run: Path) -> int:
    """Numbers in the run's trainable tensors as saved: adapters for LoRA, the HF export for full weights."""
    from safetensors import safe_open

    lora = run / "lora" / "adapters.safetensors"
    files = [lora] if lora.is_file() else sorted((run / "hf").glob("*.safetensors"))
    total = 0
    for f in files:
        with safe_open(str(f), "pt") as st:
            total += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return total


def report(run: Path) -> dict:
    metrics, evals = rows(run / "metrics.jsonl"), rows(run / "eval.jsonl")
    if not metrics or not evals:
        raise SystemExit(f"{run}: no metrics.jsonl / eval.jsonl (not a finished run directory)")
    total = lambda key: sum(m.get(key, 0.0) for m in metrics)  # noqa: E731
    return {
        "run": str(run),
        "trainable_params": saved_params(run),
        "peak_rss_gb": max(m.get("mem_peak_gb", float("nan")) for m in metrics),
        "heldout": [(e["step"], e["mean_at_k"], e["pass_at_k"]) for e in evals],
        "reward": [(m["step"], m["reward_mean"]) for m in metrics],
        "minutes": {p: total(f"time_{p}") / 60 for p in ("generate", "train", "sync")},
    }


def plot(full: dict, lora: dict, out: Path, label: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r, name, color in ((full, "full weights", "tab:blue"), (lora, label, "tab:red")):
        ax.plot(*zip(*r["reward"]), color=color, alpha=0.35, label=f"{name}: train reward")
        steps, mean, _ = zip(*r["heldout"])
        ax.plot(steps, mean, "o-", color=color, label=f"{name}: held-out mean@4")
    ax.set_xlabel("optimizer update")
    ax.set_ylabel("reward / accuracy (a+b, 32 held-out prompts)")
    ax.set_title("Main job: full weights vs LoRA (SmolLM2-135M-Instruct)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def train(run: Path, overrides: list[str]) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "mcore_rl.train", f"run.dir={run}", "logging.progress=false", *overrides]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, env=env, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="lora_main_job", help="run directories, the table and the PNG go here")
    ap.add_argument(
        "--full", default=None, help="report this finished full-weight run instead of training one"
    )
    ap.add_argument("--lora", default=None, help="report this finished LoRA run instead of training one")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--lora-lr", type=float, default=2e-4)
    ap.add_argument("overrides", nargs="*", help="extra mcore-rl-train overrides for both runs")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    full, lora = Path(a.full or out / "full"), Path(a.lora or out / "lora")
    if not a.full:
        train(full, a.overrides)
    if not a.lora:
        train(lora, [f"model.lora.rank={a.rank}", f"model.lora.alpha={a.alpha}", f"optim.lr={a.lora_lr}",
                     *a.overrides])  # fmt: skip
    res = {"full": report(full), "lora": report(lora)}
    label = f"LoRA r={a.rank}" if not a.lora else "LoRA"
    print(
        f"{'':<14}{'trainable params':>18}{'peak RSS GB':>13}{'generate min':>14}{'train min':>11}  held-out mean@4"
    )
    for name, r in res.items():
        curve = " -> ".join(f"{m:.3f}" for _, m, _ in r["heldout"])
        print(
            f"{name:<14}{r['trainable_params']:>18,}{r['peak_rss_gb']:>13.2f}{r['minutes']['generate']:>14.1f}"
            f"{r['minutes']['train']:>11.1f}  {curve}"
        )
    ratio = res["lora"]["trainable_params"] / res["full"]["trainable_params"]
    print(
        f"LoRA trains {100 * ratio:.2f}% of the parameters at {res['lora']['peak_rss_gb'] / res['full']['peak_rss_gb']:.2f}x "
        f"the peak RSS; PNG: {plot(res['full'], res['lora'], out / 'lora_vs_full.png', label)}"
    )
    (out / "lora_vs_full.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
