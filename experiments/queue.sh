#!/bin/bash
# The background queue: every arm of every experiment, one after another (never concurrently).
#   nohup bash experiments/queue.sh > /work/exp_runs/queue.log 2>&1 &
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH="$PWD"
python experiments/mu_grpo_vs_grpo/run.py
[ -f experiments/scaling_prediction/run.py ] && python experiments/scaling_prediction/run.py
[ -f experiments/p3o_vs_grpo/run.py ] && python experiments/p3o_vs_grpo/run.py
echo "queue done $(date -u)"
