#!/usr/bin/env bash
# Run a command as on the AVX2-only machine kind (no AVX-512, no AMX, no native bf16) from a CPU that has them:
# torch's own kernels, MKL and oneDNN each capped at AVX2. On an AVX-512 + avx512_bf16 EPYC this measured bf16
# torch.mm at 2 GFLOP/s (an AVX2-only EPYC: 1), so `model.dtype=auto` picks fp32 as it does there. It reproduces
# the dtype choice, not the speed: fp32 torch.mm stayed at 148-188 GFLOP/s quiet (the AVX2-only EPYC: 109; MKL
# runs AVX2 kernels on AMD CPUs anyway). Compare ratios from one machine.
#   bash scripts/as_avx2.sh bash scripts/run_main.sh
#   bash scripts/as_avx2.sh python benchmarks/policy_step.py --dtypes fp32
# Its own torch.compile (inductor) cache: inductor's on-disk cache is not keyed by ATEN_CPU_CAPABILITY, and a
# kernel compiled for AVX-512 loaded by a wrapper generated for AVX2 (or the reverse) computed wrong values and
# corrupted the heap (chunked log-probs off by 4.8 nats; `free(): invalid size`), in either order.
set -euo pipefail
export ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
export TORCHINDUCTOR_CACHE_DIR="${MCORE_RL_AVX2_INDUCTOR_CACHE:-${TMPDIR:-/tmp}/torchinductor_${USER:-$(id -un)}_avx2}"
exec "$@"
