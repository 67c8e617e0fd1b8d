"""Where a run's numbers go on rank 0: metrics.jsonl / eval.jsonl / TensorBoard (MetricsLogger), the progress
bar, and at the end the curves and the summary line. Other ranks hold a disabled RunLog and write nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mcore_rl.config import LoggingConfig
from mcore_rl.metrics_log import MetricsLogger, memory_gb, plot_run


class RunLog:
    def __init__(
        self,
        run_dir: Path,
        settings: LoggingConfig,
        total_updates: int,
        enabled: bool,
        record: dict[str, Any] | None = None,
        dtype: str | None = None,  # the run's resolved training dtype: the speed summary's roofline
    ) -> None:
        self.run_dir, self.settings, self.total, self.enabled = run_dir, settings, total_updates, enabled
        self.dtype = dtype
        self.logger = MetricsLogger(run_dir, settings, enabled=enabled, config=record)
        self.last_heldout: float | None = None
        self._bar = None

    def log(self, update: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        metrics.update(memory_gb())
        self.logger.log(update, metrics)
        if self.settings.progress:
            self._progress(update, metrics)

    def log_eval(self, update: int, metrics: dict[str, Any]) -> None:
        self.last_heldout = metrics["mean_at_k"]
        self.logger.log(update, metrics, kind="eval")

    def _progress(self, update: int, metrics: dict[str, float]) -> None:
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, initial=update - 1, desc="updates", dynamic_ncols=True)
        self._bar.update(update - self._bar.n)
        post = {"reward": f"{metrics.get('reward_mean', 0):.3f}"}
        if self.last_heldout is not None:
            post["heldout"] = f"{self.last_heldout:.3f}"
        if "tokens_per_s" in metrics:  # set on a round's last record only: never a partial-round rate
            post["tok/s"] = f"{metrics['tokens_per_s']:.0f}"
        self._bar.set_postfix(post)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        self.logger.close()
        if self.settings.plot:
            plot_run(self.run_dir)
        from mcore_rl.evaluation.summary import run_summary

        print(run_summary(self.run_dir), flush=True)
        print(self._speed(), flush=True)

    def _speed(self) -> str:
        """Tokens/s per phase and the fraction of the dtype's matmul roofline (`trainer/speed.py`); also appended
        to run_dir/summary.jsonl."""
        from mcore_rl.policy.precision import roofline_gflops
        from mcore_rl.trainer.speed import write_speed_summary

        dtype = self.dtype
        return write_speed_summary(self.run_dir, dtype, roofline_gflops(dtype) if dtype else None)
