"""Metrics to jsonl + TensorBoard (+ wandb when configured), a progress bar, and PNG curves at the end."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from mcore_rl.config.logs import LoggingConfig


def memory_gb() -> dict[str, float]:
    """Resident and peak resident memory of this process (Linux /proc), in GB."""
    out: dict[str, float] = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "VmHWM:")):
                key = "mem_rss_gb" if line.startswith("VmRSS") else "mem_peak_gb"
                out[key] = int(line.split()[1]) / 1e6
    except OSError:
        pass
    return out


class MetricsLogger:
    """Rank-0 sink. `log(step, metrics)` appends one JSON line and one TensorBoard scalar per metric (NaN and inf
    included: they are logged as such)."""

    def __init__(self, run_dir: str | Path, cfg: LoggingConfig | Any | None = None, enabled: bool = True, config: dict | None = None):
        self.dir = Path(run_dir)
        self.enabled = enabled
        self.jsonl = self.dir / "metrics.jsonl"
        self.eval_jsonl = self.dir / "eval.jsonl"
        self._tb = self._wandb = None
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        if cfg is not None and not isinstance(cfg, LoggingConfig):  # the `logging` group as a dict / DictConfig
            cfg = LoggingConfig(**cfg)
        if cfg is None or cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tensorboard"))
        if cfg is not None and cfg.wandb:
            import wandb  # optional dependency

            self._wandb = wandb.init(project=cfg.wandb_project, config=config, dir=str(self.dir))

    def _write(self, path: Path, record: dict) -> None:
        with path.open("a") as f:
            f.write(json.dumps(record, default=float) + "\n")

    def log(self, step: int, metrics: dict[str, float], kind: str = "train") -> None:
        if not self.enabled:
            return
        # Non-finite values are kept: a NaN loss must show up as NaN (JSON `NaN`/`Infinity`, which Python's json
        # reads back), never vanish so the run looks healthy.
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        record = {"step": step, "time": time.time(), **clean}
        self._write(self.jsonl if kind == "train" else self.eval_jsonl, record)
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(f"{kind}/{k}", v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({f"{kind}/{k}": v for k, v in clean.items()}, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_jsonl(path: str | Path) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path | None:
    """Reward / held-out accuracy curves and per-phase time, as one PNG (people look rather than read)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    train, evals = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "eval.jsonl")
    if not train:
        return None
    episodes = any("env/turns" in r for r in train)  # an env= run: tool use and turns get their own panel
    fig, axes = plt.subplots(1, 3 if episodes else 2, figsize=(18 if episodes else 12, 4.2))
    steps = [r["step"] for r in train]
    ax = axes[0]
    if any("reward_mean" in r for r in train):
        ax.plot(steps, [r.get("reward_mean", float("nan")) for r in train], label="train reward (per step)", alpha=0.6)
    if evals:
        ax.plot([r["step"] for r in evals], [r.get("mean_at_k", float("nan")) for r in evals], "o-",
                label="held-out mean@k")
        ax.plot([r["step"] for r in evals], [r.get("pass_at_k", float("nan")) for r in evals], "s--",
                label="held-out pass@k")
    ax.set_xlabel("optimizer update")
    ax.set_ylabel("reward / accuracy")
    ax.set_title("Reward")
    ax.grid(alpha=0.3)
    ax.legend()
    ax = axes[1]
    phases = [k for k in ("time_generate", "time_reward", "time_old_logp", "time_train", "time_sync")
              if any(k in r for r in train)]
    bottom = [0.0] * len(train)
    for k in phases:
        vals = [r.get(k, 0.0) for r in train]
        ax.bar(steps, vals, bottom=bottom, label=k.removeprefix("time_"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("optimizer update")
    ax.set_ylabel("seconds")
    ax.set_title("Time per phase")
    ax.legend()
    if episodes:
        _plot_episodes(axes[2], steps, train, evals)
    fig.tight_layout()
    path = Path(out) if out else run_dir / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot_episodes(ax, steps: list[int], train: list[dict], evals: list[dict]) -> None:
    """Valid tool-call rate (a fraction, left axis) and turns / tool calls per episode (counts, right axis): what
    an agentic run learns besides its reward."""
    get = lambda rows, k: [r.get(k, float("nan")) for r in rows]  # noqa: E731
    ax.plot(steps, get(train, "env/valid_tool_call_rate"), color="tab:green", alpha=0.6,
            label="valid tool-call rate (train)")
    held = [r for r in evals if "env/valid_tool_call_rate" in r]
    if held:
        ax.plot([r["step"] for r in held], get(held, "env/valid_tool_call_rate"), "o-", color="tab:green",
                label="valid tool-call rate (held-out)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("optimizer update")
    ax.set_ylabel("fraction of tool calls")
    ax.set_title("Episodes")
    ax.grid(alpha=0.3)
    right = ax.twinx()
    right.plot(steps, get(train, "env/turns"), color="tab:purple", label="turns / episode (train)")
    right.plot(steps, get(train, "env/tool_calls"), "--", color="tab:orange", label="tool calls / episode (train)")
    right.set_ylabel("per episode")
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8)
