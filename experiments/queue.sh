#!/bin/bash
# The background queue: every (seed, arm) of every experiment, one run after another (never concurrently).
# Resumable: rerun the same command after an interruption; finished runs (DONE marker) are skipped, interrupted ones
# resume from their checkpoint (experiments/plan.py). `--dry-run` prints the plan, nothing runs.
#   nohup bash experiments/queue.sh > /work/exp_runs/queue.log 2>&1 &
#   SEEDS=5 bash experiments/queue.sh            # more seeds: seeds 1234..1238, the first 3 reused
#   GPU_MODEL=/models/Qwen2.5-0.5B-Instruct bash experiments/queue.sh     # the GPU profile (common.GPU_OVERRIDES)
# CODE (optional): a frozen copy of the repository whose mcore_rl the arms import (e.g. `git archive HEAD | tar -x
# -C DIR && git rev-parse --short HEAD > DIR/COMMIT`), so that editing the working tree while the queue runs cannot
# change (or break) runs not yet started.
#   UNTIL=17:30 bash experiments/queue.sh       # start no run expected to end after 17:30 UTC (deadline.py), then
#                                                 # stop as --stop does: the machine is quiet by then
#   bash experiments/queue.sh --stop             # the running trainer checkpoints and exits, its time is recorded,
#                                                 # and the queue ends; the same command as before resumes it
# The whole script is one function, read by bash before it runs: editing this file while a queue runs cannot
# change what the running queue does next.
main() {
    cd "$(dirname "$0")/.." || exit 1
    local stop="${MCORE_RL_EXP_ROOT:-/work/exp_runs}/STOP"  # experiments/common.py stop_file()
    if [[ ${1:-} == --stop ]]; then
        mkdir -p "$(dirname "$stop")" && touch "$stop"
        pkill -TERM -f 'experiments/[a-z0-9_]+/run[.]py'
        echo "stop requested: the running trainer checkpoints and exits, then the queue ends"
        exit 0
    fi
    rm -f "$stop"  # a request left from before this queue started
    export PYTHONPATH="${CODE:-$PWD}"
    # the commit the arms run, recorded in every segment of arm.json: of the frozen copy (its COMMIT file, written
    # by the recipe in experiments/README.md), else of this checkout
    MCORE_RL_EXP_CODE="$(cat "${CODE:-/nonexistent}/COMMIT" 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo '?')"
    export MCORE_RL_EXP_CODE
    # a finished run keeps its records, not its checkpoints (~2 GB each; the full queue would fill a 100 GB disk):
    # MCORE_RL_EXP_DROP_CHECKPOINTS=0 keeps them (needed only to extend a finished arm to more updates)
    export MCORE_RL_EXP_DROP_CHECKPOINTS="${MCORE_RL_EXP_DROP_CHECKPOINTS:-1}"
    args=(--seeds "${SEEDS:-3}" ${GPU_MODEL:+--gpu "$GPU_MODEL"} ${UNTIL:+--until "$UNTIL"} "$@")
    # Two passes: every experiment's headline arms (what its claim compares: a verdict per paper comes first), then
    # the rest (ablations, k=4, mu=1/4); finished runs are skipped, so the second pass only adds.
    for pass in --headline --all; do
        for exp in ppo_ewma_async mu_grpo_vs_grpo p3o_vs_grpo scaling_prediction; do
            if [[ -e $stop ]]; then
                rm -f "$stop"
                echo "queue stopped $(date -u); rerun the same command to resume"
                exit 0
            fi
            sel=(); [[ $pass == --headline ]] && sel=(--headline)
            python "experiments/$exp/run.py" "${args[@]}" "${sel[@]}"
            rc=$?
            if [[ $rc == 75 ]]; then  # common.STOPPED_EXIT: stopped on request
                rm -f "$stop"
                echo "queue stopped $(date -u); rerun the same command to resume"
                exit 0
            fi
            [[ $rc == 0 ]] || echo "$exp ($pass): exit $rc (continuing with the next experiment)"
        done
    done
    echo "queue done $(date -u)"
}
main "$@"
exit $?
