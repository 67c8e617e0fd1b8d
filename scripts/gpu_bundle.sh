#!/usr/bin/env bash
# What scripts/gpu_checks.sh needs on an offline CUDA machine whose Python already holds torch and transformers (a
# cluster image, a lent node without internet), bundled here into .gpu/ to copy there with the checkout:
#   .gpu/site   the Python packages mcore-rl imports that such an image lacks (megatron-core, hydra, omegaconf, the
#               math verifier, gguf), installed for the target's Python version with no dependencies (its torch
#               and transformers are used as they are)
#   .gpu/cache  the tiny test models the gpu suite trains (model=tiny, model=tiny_sevens), so that no SmolLM2
#               download is needed there
# ~50 MB. On the CUDA machine, from the checkout: bash scripts/gpu_checks.sh (it uses .gpu/ when present).
#   bash scripts/gpu_bundle.sh            # the target runs Python 3.12 (pyenv's 3.12.1 builds the bundle)
#   MCORE_RL_GPU_PY=/path/to/python3.X bash scripts/gpu_bundle.sh   # another target version
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${MCORE_RL_GPU_PY:-}
if [[ -z $PY ]] && command -v pyenv >/dev/null 2>&1; then
  PY="$(pyenv prefix 3.12.1 2>/dev/null)/bin/python" || PY=""
fi
[[ -n $PY && -x $PY ]] || { echo "gpu_bundle.sh: no interpreter of the target's version (set MCORE_RL_GPU_PY)" >&2; exit 2; }
rm -rf .gpu/site .gpu/cache
mkdir -p .gpu/cache
# versions: the ones the CPU legs test (megatron-core: the Python 3.12 leg's); antlr4 4.9.3 is what hydra-core pins
"$PY" -m pip install -q --no-deps --no-compile --target .gpu/site megatron-core==0.19.2 omegaconf==2.3.1 \
  hydra-core==1.3.8 antlr4-python3-runtime==4.9.3 math-verify==0.9.0 latex2sympy2_extended==1.11.0 gguf==0.19.0
python - <<'EOF'
import shutil
from pathlib import Path

from omegaconf import OmegaConf

from mcore_rl.models.source import tiny_model_dir

def fields(name: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(f"hydra_conf/model/{name}.yaml").tiny)


tiny = fields("tiny")
for spec in (tiny, {**tiny, **fields("tiny_sevens")}):  # tiny_sevens.yaml: defaults [tiny, _self_]
    src = tiny_model_dir(spec)
    shutil.copytree(src, Path(".gpu/cache") / src.name)
    print("bundled", src.name)
EOF
du -sh .gpu
