"""`trainer.*`: how many updates, how big, how sampled, and how the run saves and resumes."""

from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.config.checks import ConfigError, one_of, positive


@dataclass
class TrainerConfig:
    steps: int = 20                 # optimizer updates (each round of generation serves mu of them)
    # prompts behind one optimizer update (x samples_per_prompt sequences): 16, not 8, because 8 left the main
    # job's result to the seed (docs/performance.md, 4 seeds each)
    prompts_per_update: int = 16
    samples_per_prompt: int = 4     # group size G
    max_new_tokens: int = 48
    temperature: float = 0.7
    top_p: float = 1.0
    token_budget: int = 512         # tokens per micro-batch (rows x padded length): bounds activation memory
    # leave rows whose gradient is exactly zero (advantage 0 under a loss linear in it, or all-zero weights) out
    # of the forward/backward: same update, less compute; per-token metrics then cover the trained rows only
    skip_inert_rows: bool = True
    # old_logp_source=recompute with one optimizer update per round: the anchor is the live weights' forward, which
    # the update's own forward computes again, so take it from there (detached) and skip the separate scoring
    # forward (16-18% of a GRPO round on CPU). Same update; off = the separate forward (A/B, benchmarks)
    reuse_old_logp: bool = True
    # a micro-batch's rows concatenated without pad tokens (Megatron's THD layout): auto = on CUDA in bf16/fp16
    # where PyTorch has flash attention's varlen kernel (an H200: 1.15x the padded step on ragged rows, -21%
    # peak memory), off elsewhere (on CPU the per-sequence attention ran 0.76-0.87x) | true | false
    pack_rows: str = "auto"
    resume: str = "auto"            # auto: continue from run.dir/checkpoints/latest if present | never
    save_every: int = 10            # checkpoint every N steps (0 = only at the end)
    keep_checkpoints: int = 2       # newest checkpoints kept (0 = keep every one)
    export_hf: bool = True          # write an HF folder (run.dir/hf) at the end
    # fixed threads + seeds: resumed runs reproduce an uninterrupted run's losses. null = on with the embedded
    # engine (free there), off with SGLang (its sampling is reproducible only with batch-invariant kernels, which
    # cost throughput): see resolve_deterministic
    deterministic: bool | None = None
    sync_weights: bool = True       # push new weights to the rollout engine after every update
    max_nonfinite_skips: int = 3    # non-finite updates skipped in a row before the run stops
    # Seconds a rank may wait in one collective before its process group fails the run (every group: the default,
    # the host gloo group, Megatron's). Long, because the longest legitimate wait is the other ranks sitting in
    # the sample broadcast while rank 0 alone generates and scores a round (plus held-out eval, checkpoint save,
    # the HF export): long-response rounds on a busy engine take tens of minutes, and a timeout there kills a
    # healthy run. The price of a long value is only how late a real hang is reported.
    dist_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        positive("trainer.steps", self.steps, allow_zero=True)
        for key in ("prompts_per_update", "samples_per_prompt", "max_new_tokens", "token_budget",
                    "max_nonfinite_skips"):
            positive(f"trainer.{key}", getattr(self, key))
        positive("trainer.save_every", self.save_every, allow_zero=True)
        positive("trainer.keep_checkpoints", self.keep_checkpoints, allow_zero=True)
        positive("trainer.dist_timeout_s", self.dist_timeout_s)
        if self.temperature <= 0:
            raise ConfigError(f"trainer.temperature={self.temperature} must be > 0 for RL sampling")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"trainer.top_p={self.top_p} must be in (0, 1]")
        one_of("trainer.resume", self.resume, ("auto", "never"))
        self.pack_rows = str(self.pack_rows).lower()  # a bare `trainer.pack_rows=true` arrives as "True"
        one_of("trainer.pack_rows", self.pack_rows, ("auto", "true", "false"))


def resolve_deterministic(value: bool | None, engine: str) -> bool:
    """trainer.deterministic as the run uses it: an explicit true/false wins; null means reproducible where it
    costs nothing (the embedded engine) and fast where reproducibility has a price (SGLang servers would need
    --enable-deterministic-inference on every server)."""
    if value is not None:
        return bool(value)
    return engine != "sglang"
