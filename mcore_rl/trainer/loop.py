"""The RL loop, one round per iteration, in the order it happens:

    generate (schedule) -> reward -> advantages -> anchors (old / ref log-probs) -> mu optimizer updates
    -> weight sync -> log / evaluate / checkpoint

The schedule (trainer/schedule/: sync, staged, async) decides when generation is submitted, what happens around
training (staged: the engine releases its memory) and how many updates a round serves; the loop is the same for
all. `trainer.steps` counts optimizer updates (U in the Mu-GRPO paper), so schedules compare at equal budgets.
The components come from trainer/build.py; the counters live in one RunState, saved with every checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from mcore_rl.compat.malloc import trim
from mcore_rl.trainer.build import Components
from mcore_rl.trainer.state import RunState


@contextmanager
def timed(times: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    yield
    times[name] = times.get(name, 0.0) + time.perf_counter() - t0


def train(c: Components, state: RunState) -> dict[str, float]:
    """Train until `trainer.steps` updates or a stop signal; returns the last update's metrics."""
    steps, last = c.settings.steps, {}
    if state.update == 0:
        c.evaluator.maybe_run(state, force=True)  # the baseline every later evaluation is compared against
    while state.update < steps and not c.stop.agreed():
        times: dict[str, float] = {}
        n_up = min(c.schedule.updates_per_round, steps - state.update)
        with timed(times, "time_generate"):
            rnd = c.rounds.next(n_up, state)  # rank 0 generates and scores; every rank receives the round
        if rnd is None:  # a stop signal aborted generation: checkpoint (in-flight prompts listed) and stop
            break
        state.round += 1
        rb, rollout_metrics = rnd.batch, rnd.metrics
        adv = c.algorithm.advantages(rb.rewards, rb.group_ids, lengths=rb.response_len)
        with timed(times, "time_switch"):
            c.schedule.before_train()  # staged: the engine releases its memory
        with timed(times, "time_old_logp"):
            anchors = c.learner.anchors(rb, state.version)  # old_logp and ref_logp for the whole round
        rollout_metrics.update(c.oldlogp.metrics())  # snapshot memory, missing-old-logit error
        for u in range(n_up):
            state.update += 1
            last = c.learner.update(rb, adv, anchors, u, n_up, state.update, state.round, rnd.prompt_ids)
            last.update(
                {k: v / n_up for k, v in times.items() if k != "time_switch"}
            )  # spread over the round
            last.update(rollout_metrics)
            last.update({"adv_" + k: v for k, v in adv.metrics.items()})
            last["zero_variance_groups_dropped"] = float(adv.num_zero_variance_groups)
            if u < n_up - 1:
                c.runlog.log(state.update, last)
        trim()  # the round's freed activation buffers back to the OS (compat/malloc.py: RSS grew per update)
        if c.rounds.compute is not None:  # rank 0: rows no update trained cost no training FLOPs
            c.rounds.compute.skip_training(c.learner.skipped_lengths(rb, adv))
        with timed(times, "time_switch"):
            c.schedule.after_train()  # staged: the engine takes its memory back
        with timed(times, "time_sync"):
            c.schedule.before_sync()  # async, deterministic: in-flight rounds finish on the weights they started with
            last.update(c.weights.publish(state))  # version + 1 in the engine and the old-log-prob source
        last.update(time_sync=times["time_sync"], time_switch=times["time_switch"])  # the round's last record
        last["tokens_per_s"] = rollout_metrics.get("rollout_tokens", 0.0) / max(sum(times.values()), 1e-9)
        c.runlog.log(state.update, last)
        c.evaluator.maybe_run(state)
        c.checkpointer.maybe_save(state, n_up, stopping=c.stop.agreed())
    finish(c, state)
    return last


def finish(c: Components, state: RunState) -> None:
    """Preempted: checkpoint and mark run.dir (a requeued job resumes). Finished: the last checkpoint, the final
    evaluation and the HF export. Then rank 0 closes the engine, reward workers and logs."""
    preempted = c.stop.agreed()
    c.checkpointer.save_final(state, c.stop.signals if preempted else None)
    if not preempted:
        c.evaluator.maybe_run(state, force=True)
        if c.settings.export_hf:
            export_hf(c)
    c.close()


def export_hf(c: Components) -> None:
    """run.dir/hf: the trained policy as an HF folder (gathered to rank 0; the others stream their shards)."""
    from mcore_rl.rollout.weight_sync.disk_sync import write_hf_folder

    stream = c.policy.hf_tensors(dst=0)
    if c.rank == 0:
        write_hf_folder(stream, c.run_dir / "hf", config_dir=c.model_dir, overwrite=True)
    else:
        for _ in stream:
            pass
    from mcore_rl.policy.lora import has_adapters

    if has_adapters(c.policy.model):  # LoRA: run.dir/hf is merged; run.dir/lora the adapters (-> PEFT, docs/lora.md)
        from mcore_rl.policy.lora_state import gather_adapters, save_adapter_folder

        tensors = gather_adapters(c.policy.model)
        if c.rank == 0:
            save_adapter_folder(tensors, c.run_dir / "lora", c.policy.cfg.lora, c.model_dir)
