#!/bin/bash
# The background queue: every arm of every experiment, one after another (never concurrently).
#   nohup bash experiments/queue.sh > /work/exp_runs/queue.log 2>&1 &
# CODE (optional): a frozen copy of the repository whose mcore_rl the arms import (e.g. `git archive HEAD | tar -x
# -C DIR`), so that editing the working tree while the queue runs cannot change (or break) arms not yet started.
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH="${CODE:-$PWD}"
python experiments/mu_grpo_vs_grpo/run.py
python experiments/scaling_prediction/run.py
python experiments/p3o_vs_grpo/run.py
echo "queue done $(date -u)"
