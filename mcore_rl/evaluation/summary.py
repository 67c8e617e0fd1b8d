"""The few lines a person reads when a run ends: held-out metrics first vs last, where the time went, and where
the outputs are. Built from the run directory's own files, so it also works on any finished run later."""

from __future__ import annotations

from pathlib import Path

from mcore_rl.metrics_log import read_jsonl

_PHASES = ("time_generate", "time_reward", "time_old_logp", "time_train", "time_sync", "time_switch")


def _fmt_s(s: float) -> str:
    return f"{s / 3600:.2f} h" if s >= 3600 else f"{s / 60:.1f} min" if s >= 120 else f"{s:.1f} s"


def run_summary(run_dir: str | Path) -> str:
    run_dir = Path(run_dir)
    train, evals = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "eval.jsonl")
    lines = [f"run summary ({run_dir})"]
    if evals:
        first, last = evals[0], evals[-1]
        keys = [k for k in ("mean_at_k", "pass_at_1", "pass_at_k", "response_len") if k in first and k in last]
        lines.append(f"  held-out, update {first['step']} -> {last['step']}: " + ", ".join(
            f"{k} {first[k]:.3f} -> {last[k]:.3f}" for k in keys))
    if train:
        phases = {k.removeprefix("time_"): sum(r.get(k, 0.0) for r in train) for k in _PHASES}
        phases["eval"] = sum(r.get("time_eval", 0.0) for r in evals)
        total = sum(phases.values())
        wall = evals[-1].get("wallclock_s") if evals else None
        parts = ", ".join(f"{k} {_fmt_s(v)} ({v / max(total, 1e-9):.0%})" for k, v in phases.items() if v >= 0.05)
        lines.append(f"  {len(train)} updates; time by phase: {parts}"
                     + (f"; wall-clock {_fmt_s(wall)}" if wall is not None else ""))
        if evals and "flops" in evals[-1]:
            lines.append(f"  compute: {evals[-1]['flops']:.3g} FLOPs (train {evals[-1]['flops_train']:.3g}, "
                         f"generate {evals[-1]['flops_generate']:.3g}, score {evals[-1]['flops_score']:.3g})")
    outputs = [("metrics", "metrics.jsonl"), ("eval", "eval.jsonl"), ("plot", "curves.png"),
               ("checkpoints", "checkpoints"), ("hf export", "hf"), ("tensorboard", "tensorboard")]
    found = [f"{name} {run_dir / rel}" for name, rel in outputs if (run_dir / rel).exists()]
    if found:
        lines.append("  outputs: " + "; ".join(found))
    return "\n".join(lines)
