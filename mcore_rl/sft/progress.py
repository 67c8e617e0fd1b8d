"""Where an SFT run's numbers go on rank 0: metrics.jsonl / eval.jsonl / TensorBoard (the RL run's MetricsLogger),
a progress bar, and at the end curves.png (train and held-out loss, learning rate, tokens/s)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mcore_rl.config import LoggingConfig
from mcore_rl.metrics_log import MetricsLogger, memory_gb, read_jsonl


class SftLog:
    def __init__(
        self,
        run_dir: Path,
        settings: LoggingConfig,
        total_steps: int,
        enabled: bool,
        record: dict[str, Any] | None = None,
    ) -> None:
        self.run_dir, self.settings, self.total, self.enabled = run_dir, settings, total_steps, enabled
        self.logger = MetricsLogger(run_dir, settings, enabled=enabled, config=record)
        self.last_heldout: float | None = None
        self._bar = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        metrics.update(memory_gb())
        self.logger.log(step, metrics)
        if self.settings.progress:
            if self._bar is None:
                from tqdm import tqdm

                self._bar = tqdm(total=self.total, initial=step - 1, desc="sft steps", dynamic_ncols=True)
            self._bar.update(step - self._bar.n)
            post = {"loss": f"{metrics['loss']:.4f}", "tok/s": f"{metrics.get('tokens_per_s', 0):.0f}"}
            if self.last_heldout is not None:
                post["heldout"] = f"{self.last_heldout:.4f}"
            self._bar.set_postfix(post)

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        self.last_heldout = metrics["heldout_loss"]
        self.logger.log(step, metrics, kind="eval")
        print(f"held-out loss @ step {step}: {metrics['heldout_loss']:.5f}", flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        self.logger.close()
        if self.settings.plot:
            plot_sft(self.run_dir)


def plot_sft(run_dir: Path) -> Path | None:
    """curves.png: loss per step with the held-out loss, the learning rate, tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "eval.jsonl")
    if not train and not evals:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    steps = [r["step"] for r in train]
    axes[0].plot(
        steps, [r.get("loss", float("nan")) for r in train], label="train loss (per step)", alpha=0.7
    )
    axes[0].plot([r["step"] for r in evals], [r["heldout_loss"] for r in evals], "o-", label="held-out loss")
    axes[0].set(xlabel="optimizer step", ylabel="token-mean NLL", title="Loss")
    axes[0].legend()
    axes[1].plot(steps, [r.get("lr", float("nan")) for r in train])
    axes[1].set(xlabel="optimizer step", title="Learning rate")
    axes[2].plot(steps, [r.get("tokens_per_s", float("nan")) for r in train])
    axes[2].set(xlabel="optimizer step", title="Assistant tokens / s")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = run_dir / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
