"""The RL loop. One round = generate -> reward -> advantages -> anchors -> mu optimizer updates -> weight sync.

The schedule (trainer/schedule/: sync, staged, async) decides when generation is submitted, what happens around
training (staged: the engine releases its memory) and how many updates a round serves; the loop is the same for
all. `trainer.steps` counts optimizer updates (U in the Mu-GRPO paper), so schedules compare at equal budgets.
"""

from __future__ import annotations

import time
from contextlib import contextmanager


@contextmanager
def timed(times: dict[str, float], name: str):
    t0 = time.perf_counter()
    yield
    times[name] = times.get(name, 0.0) + time.perf_counter() - t0


def train(run) -> dict[str, float]:
    """`run` is a trainer.run.Run (everything built). Returns the last metrics."""
    cfg, alg, sched = run.cfg, run.algorithm, run.schedule
    steps, last = cfg.trainer.steps, {}
    if run.update == 0:
        run.maybe_evaluate(force=True)  # the baseline every later evaluation is compared against
    while run.update < steps and not run.stop.agreed():
        times: dict[str, float] = {}
        n_up = min(sched.updates_per_round, steps - run.update)
        with timed(times, "time_generate"):
            batch = run.next_batch(n_up)  # rank 0 generates and scores; every rank receives the batch
        if batch is None:  # a stop signal aborted generation: checkpoint (in-flight prompts listed) and stop
            break
        rb, rollout_metrics = batch
        adv = alg.advantages(rb.rewards, rb.group_ids, lengths=rb.response_len)
        with timed(times, "time_switch"):
            sched.before_train()  # staged: the engine releases its memory
        with timed(times, "time_old_logp"):
            anchors = run.anchors(rb)  # old_logp (recompute) and ref_logp for the whole round
        rollout_metrics.update(run.oldlogp.metrics())  # oldlogp hook: snapshot memory, missing-old-logit error
        for u in range(n_up):
            metrics = run.train_update(rb, adv, anchors, u, n_up)
            metrics.update({k: v / n_up for k, v in times.items() if k != "time_switch"})  # spread over the round
            metrics.update(rollout_metrics)
            metrics.update({"adv_" + k: v for k, v in adv.metrics.items()})
            metrics["zero_variance_groups_dropped"] = float(adv.num_zero_variance_groups)
            last = metrics
            if u < n_up - 1:
                run.log(metrics)
        with timed(times, "time_switch"):
            sched.after_train()  # staged: the engine takes its memory back
        with timed(times, "time_sync"):
            sched.before_sync()  # async, deterministic: in-flight rounds finish on the weights they started with
            last.update(run.sync_weights())
        last.update(time_sync=times["time_sync"], time_switch=times["time_switch"])  # the round's last record
        last["tokens_per_s"] = rollout_metrics.get("rollout_tokens", 0.0) / max(sum(times.values()), 1e-9)
        run.log(last)
        run.maybe_evaluate()
        run.maybe_checkpoint()
    run.finish()
    return last
