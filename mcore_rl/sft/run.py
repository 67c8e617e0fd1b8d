"""An SFT run: build (data, policy, log), train step by step, evaluate, checkpoint, export.

The parts RL already has are reused as they are: the policy and its optimizer / LR schedule (policy/), the model
folder and parallel-layout checks and the network's build settings (trainer/setup.py), the crash-consistent
checkpoints (trainer/state.py, checkpoint_io.py), the metrics sink (metrics_log.py), the preemption flag and the
HF export (trainer/loop.export_hf). What is SFT's own is the data (data.py, template.py), the loss (step.py) and
the order rows are visited in (`step_rows`), which is a function of the step alone, so a resumed run trains on
exactly the rows an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcore_rl.config import ConfigError
from mcore_rl.policy.policy import Policy, PolicyConfig
from mcore_rl.sft.config import SftMainConfig
from mcore_rl.sft.data import load_sft_data
from mcore_rl.sft.progress import SftLog
from mcore_rl.sft.step import heldout_loss, train_step
from mcore_rl.sft.template import Example, TemplateMasker
from mcore_rl.trainer.setup import StopFlag, build_config, check_model_against_parallel, resolve_pack_rows
from mcore_rl.trainer.update import NonFiniteGuard

log = logging.getLogger("mcore_rl")


@dataclass
class SftRun:
    """What `train_sft` needs; field names match what trainer/loop.export_hf reads (policy, rank, run_dir,
    model_dir)."""

    cfg: SftMainConfig
    rank: int
    dp: int
    dp_rank: int
    run_dir: Path
    model_dir: Path
    policy: Policy
    train: list[Example]
    heldout: list[Example]
    steps: int
    runlog: SftLog
    stop: StopFlag
    step: int = 0
    next_eval: int = 0
    last_eval: int | None = None  # the step last evaluated (once per step at most)


def step_rows(step: int, n: int, batch_size: int, seed: int) -> list[int]:
    """The train rows of optimizer step `step` (0-based): positions [step*B, (step+1)*B) of the endless stream
    of seeded per-epoch permutations (epoch e shuffled with seed + e)."""
    out: list[int] = []
    for pos in range(step * batch_size, (step + 1) * batch_size):
        epoch, at = divmod(pos, n)
        order = list(range(n))
        random.Random(seed + epoch).shuffle(order)
        out.append(order[at])
    return out


def total_steps(cfg: SftMainConfig, n_train: int) -> int:
    s = cfg.sft
    return s.steps if s.steps is not None else s.epochs * -(-n_train // s.batch_size)


def _data(cfg: SftMainConfig, model_dir: Path, rank: int) -> tuple[list[Example], list[Example]]:
    """Rank 0 tokenises (one CPU pass, not one per rank) and sends the examples to every rank."""
    from mcore_rl.distributed import broadcast_object

    out: Any = None
    if rank == 0:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        try:
            masker = TemplateMasker(tok, _template(cfg.sft.data.chat_template))
            train, held, lines = load_sft_data(cfg.sft.data, masker, cfg.sft.max_length, cfg.seed)
            for line in lines:
                log.warning(line)
            out = (train, held)
        except (ConfigError, ValueError) as e:
            out = ConfigError(str(e))
    out = broadcast_object(out)
    if isinstance(out, ConfigError):
        raise out
    return out


def _template(value: str | None) -> str | None:
    """sft.data.chat_template: the text of a .jinja file it names, else the value itself (a template)."""
    if value and value.endswith(".jinja"):
        path = Path(value).expanduser()
        if not path.is_file():
            raise ConfigError(f"sft.data.chat_template={value!r}: no such file")
        return path.read_text()
    return value


def _policy(cfg: SftMainConfig, model_dir: Path, dtype: str, steps: int) -> Policy:
    """The trainable policy in the run's layout, its initial weights from model.mcore_ckpt or the HF folder, and
    the same Megatron-vs-transformers load check RL runs."""
    from mcore_rl.checkpoint_io import load_dist_checkpoint
    from mcore_rl.convert.load_check import run_load_check

    packed, why = resolve_pack_rows(cfg.sft.pack_rows, dtype)
    pcfg = PolicyConfig(
        build=build_config(cfg, dtype),
        optim=cfg.optim,
        decay_steps=max(1, steps),
        token_budget=cfg.sft.token_budget,
        packed=packed,
        seed=int(cfg.seed),
        lora=cfg.model.lora,
    )
    policy = Policy(model_dir, pcfg)
    log.warning(
        f"micro-batches: {'packed rows' if packed else 'padded rows'} ({why.replace('trainer.', 'sft.')})"
    )
    if cfg.model.mcore_ckpt:
        load_dist_checkpoint(cfg.model.mcore_ckpt, policy.model)
        policy._sync_main_params()
    else:
        policy.load_hf(model_dir)
    res = run_load_check(policy, model_dir, cfg.model.load_check, from_hf=not cfg.model.mcore_ckpt)
    log.warning(res.line(cfg.model.load_check.tol))
    if res.ran and not res.max_abs_diff <= cfg.model.load_check.tol:
        raise ConfigError(f"{res.line(cfg.model.load_check.tol)}: refusing to train")
    return policy


def build_sft(cfg: SftMainConfig) -> SftRun:
    """Every part of the run, resumed from its newest checkpoint (sft.resume=auto) or fresh."""
    from megatron.core import parallel_state as ps

    from mcore_rl.distributed import broadcast_object, init_distributed
    from mcore_rl.models.source import resolve_model_dir
    from mcore_rl.policy.precision import configure_bf16_matmul, resolve_dtype

    model_dir = resolve_model_dir(cfg.model)
    check_model_against_parallel(cfg, model_dir)  # reads only model.* and parallel.*
    p = cfg.parallel
    layout = init_distributed(p.tp, p.pp, seed=cfg.seed, ep=p.ep)
    run_dir = Path(broadcast_object(str(Path(cfg.run.dir).resolve())))
    train, held = _data(cfg, model_dir, layout.rank)
    steps = total_steps(cfg, len(train))
    dtype = resolve_dtype(cfg.model.dtype)
    configure_bf16_matmul(cfg.model.bf16_matmul, {dtype})
    policy = _policy(cfg, model_dir, dtype, steps)
    record = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype))
    runlog = SftLog(run_dir, cfg.logging, steps, layout.rank == 0, dataclasses.asdict(record))
    stop = StopFlag()
    stop.install()
    run = SftRun(
        cfg,
        layout.rank,
        layout.dp,
        ps.get_data_parallel_rank(),
        run_dir,
        model_dir,
        policy,
        train,
        held,
        steps,
        runlog,
        stop,
    )
    from mcore_rl.sft.checkpoints import restore

    restore(run)
    if layout.rank == 0:
        from omegaconf import OmegaConf

        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(record)))
    return run


def evaluate(run: SftRun) -> float | None:
    """Collective: the held-out loss, logged (kind=eval) at the current step (once per step)."""
    if run.last_eval == run.step:
        return None
    run.last_eval = run.step
    value = heldout_loss(run.policy, run.heldout[run.dp_rank :: run.dp])
    run.runlog.log_eval(run.step, {"heldout_loss": value, "heldout_conversations": float(len(run.heldout))})
    every = run.cfg.sft.eval_every
    while every > 0 and run.next_eval <= run.step:
        run.next_eval += every
    return value


def train_sft(run: SftRun) -> dict[str, float]:
    """Train until the last step or a stop signal; returns the last step's metrics."""
    from mcore_rl.sft.checkpoints import save

    s = run.cfg.sft
    guard, last = NonFiniteGuard(), {}
    if run.step == 0 and run.heldout:
        evaluate(run)  # the baseline the SFT is measured against
    while run.step < run.steps and not run.stop.agreed():
        t0 = time.perf_counter()
        rows = step_rows(run.step, len(run.train), s.batch_size, run.cfg.seed)[run.dp_rank :: run.dp]
        last = train_step(run.policy, [run.train[i] for i in rows], guard, run.step + 1)
        run.step += 1
        dt = time.perf_counter() - t0
        last.update(
            time_step=dt,
            tokens_per_s=last["train_tokens"] / max(dt, 1e-9),
            epoch=run.step * s.batch_size / len(run.train),
        )
        run.runlog.log(run.step, last)
        if run.heldout and s.eval_every > 0 and run.step >= run.next_eval and run.step < run.steps:
            evaluate(run)
        if s.save_every > 0 and run.step % s.save_every == 0:
            save(run)
    finish(run)
    return last


def finish(run: SftRun) -> None:
    """Preempted: checkpoint and stop (a restart resumes). Finished: the last checkpoint, the final held-out loss,
    the HF export; then the log closes (curves.png)."""
    from mcore_rl.sft.checkpoints import save, saved_step

    preempted = run.stop.agreed()
    if saved_step(run) != run.step and (run.step > 0 or preempted):
        save(run)
    if not preempted:
        if run.heldout:
            evaluate(run)
        if run.cfg.sft.export_hf:
            from mcore_rl.trainer.loop import export_hf

            export_hf(run)
    run.runlog.close()
