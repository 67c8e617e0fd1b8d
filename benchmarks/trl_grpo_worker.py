"""Runs inside TRL's own virtual environment (see peer_trl.py): TRL's GRPOTrainer on the mcore-rl benchmark
workload, printing one JSON line with per-step times, the generate share and peak RSS.

    <venv>/bin/python benchmarks/trl_grpo_worker.py --model DIR --steps 3 --precision fp32|bf16

Workload (identical to benchmarks/e2e_step.py): 8 prompts x 4 samples per step, <= 48 new tokens, T=0.7,
"What is a + b? Answer with just the number." (a, b <= 20), reward 1 if math-verify accepts the answer, no KL,
lr 2e-5. Everything else is TRL's default, i.e. what a TRL user gets.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import time

from scratch import scratch_dir  # benchmarks/scratch.py (sys.path[0] is this folder)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from datasets import Dataset
    from math_verify import parse, verify
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rng = random.Random(0)
    rows = []
    for _ in range(8 * (a.steps + 1)):
        x, y = rng.randint(0, 20), rng.randint(0, 20)
        rows.append({"prompt": [{"role": "user", "content": f"What is {x} + {y}? Answer with just the number."}],
                     "answer": str(x + y)})

    def reward(completions, answer, **kw):
        out = []
        for c, ans in zip(completions, answer):
            text = c[0]["content"] if isinstance(c, list) else c
            try:
                out.append(1.0 if verify(parse(ans), parse(text)) else 0.0)
            except Exception:  # math-verify raises on odd input; a wrong answer either way
                out.append(0.0)
        return out

    cfg = GRPOConfig(
        output_dir=str(scratch_dir("trl_grpo_")), per_device_train_batch_size=32, num_generations=4,
        max_completion_length=48, temperature=0.7, learning_rate=2e-5, beta=0.0, max_steps=a.steps,
        use_cpu=True, bf16=a.precision == "bf16", logging_steps=1, report_to="none", save_strategy="no",
        seed=0, dataloader_num_workers=0,
    )
    # a model object: the materialised SmolLM2 folder (from a GGUF) has no `architectures` for TRL to read;
    # fp32 weights, as TRL loads them, with bf16=True adding autocast (TRL's mixed precision)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(a.model)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=Dataset.from_list(rows),
                          processing_class=tok)
    gen_time = [0.0]
    generate = trainer.model.generate

    def timed_generate(*args, **kw):
        t = time.perf_counter()
        try:
            return generate(*args, **kw)
        finally:
            gen_time[0] += time.perf_counter() - t

    trainer.model.generate = timed_generate
    steps: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t, gen_time[0] = time.perf_counter(), 0.0

        def on_step_end(self, args, state, control, **kw):
            total = time.perf_counter() - self.t
            steps.append({"step": total, "generate": gen_time[0], "train": total - gen_time[0]})

    trainer.add_callback(Timer())
    trainer.train()
    steady = steps[1:] if len(steps) > 1 else steps  # the first step pays one-time warm-up, as in e2e_step.py
    print("TRL_RESULT " + json.dumps({
        "trainer": f"TRL GRPOTrainer {a.precision}", "steps": len(steady),
        "step": statistics.median(s["step"] for s in steady),
        "generate": statistics.median(s["generate"] for s in steady),
        "train": statistics.median(s["train"] for s in steady),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        "gradient_checkpointing": cfg.gradient_checkpointing,
    }))


if __name__ == "__main__":
    main()
