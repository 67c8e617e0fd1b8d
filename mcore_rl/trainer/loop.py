"""The RL loop. One round = generate -> reward -> advantages -> anchors -> mu optimizer updates -> weight sync.

`sync` (GRPO family): a round serves `updates_per_rollout` updates. `staged` (Mu-GRPO): a round is one large stage
serving `updates_per_stage` updates, with the engine's memory released while the trainer runs. `trainer.steps` counts
optimizer updates (U in the Mu-GRPO paper), so schedules compare at equal update budgets.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from mcore_rl.trainer.rollout_batch import update_rows
from mcore_rl.trainer.update import run_update


@contextmanager
def timed(times: dict[str, float], name: str):
    t0 = time.perf_counter()
    yield
    times[name] = times.get(name, 0.0) + time.perf_counter() - t0


def train(run) -> dict[str, float]:
    """`run` is a trainer.run.Run (everything built). Returns the last metrics."""
    cfg, alg, policy = run.cfg, run.algorithm, run.policy
    steps, last = cfg.trainer.steps, {}
    if run.update == 0:
        run.maybe_evaluate(force=True)  # the baseline every later evaluation is compared against
    while run.update < steps and not run.stop.agreed():
        times: dict[str, float] = {}
        n_up = min(run.updates_per_round, steps - run.update)
        with timed(times, "time_generate"):
            generated = run.generate(n_up)  # rank 0 generates; every rank receives the samples
        if generated is None:  # a stop signal aborted the round: drop it, checkpoint and stop (run.finish)
            break
        samples, prompts = generated
        with timed(times, "time_reward"):
            rb, rollout_metrics = run.score(samples, prompts)
        adv = alg.advantages(rb.rewards, rb.group_ids, lengths=rb.response_len)
        if run.staged:
            with timed(times, "time_switch"):
                run.engine_call("release_memory")
        with timed(times, "time_old_logp"):
            anchors = run.anchors(rb)  # old_logp (recompute) and ref_logp for the whole round
        rollout_metrics.update(run.oldlogp.metrics())  # oldlogp hook: snapshot memory, missing-old-logit error
        for u in range(n_up):
            rows = update_rows(rb.group_ids, n_up, u, run.dp, run.dp_rank)
            part = {k: v[rows] for k, v in anchors.items()}
            t0 = time.perf_counter()
            if run.ewma is not None:  # PPO-EWMA: proximal log-probs under the current EWMA weights
                part["prox_logp"] = run.prox_logp(rb.select(rows))
            metrics = run_update(policy, alg, rb.select(rows), adv.advantages[rows], adv.keep[rows], part,
                                 cfg.trainer.temperature, run.ewma, guard=run.guard, update_index=run.update + 1)
            run.update += 1
            metrics["time_train"] = time.perf_counter() - t0
            metrics.update({k: v / n_up for k, v in times.items() if k != "time_switch"})  # spread over the round
            metrics.update(rollout_metrics)
            metrics.update({"adv_" + k: v for k, v in adv.metrics.items()})
            metrics["zero_variance_groups_dropped"] = float(adv.num_zero_variance_groups)
            last = metrics
            if u < n_up - 1:
                run.log(metrics)
        if run.staged:
            with timed(times, "time_switch"):
                run.engine_call("resume_memory")
        with timed(times, "time_sync"):
            sync_metrics = run.sync_weights()
        last.update(sync_metrics)
        last["time_sync"] = times["time_sync"]  # after the round's updates: all of it lands on the last record
        if run.staged:
            last["time_switch"] = times["time_switch"]
        last["tokens_per_s"] = rollout_metrics.get("rollout_tokens", 0.0) / max(sum(times.values()), 1e-9)
        run.log(last)
        run.maybe_evaluate()
        run.maybe_checkpoint()
    run.finish()
    return last

