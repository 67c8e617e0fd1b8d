#!/usr/bin/env bash
# The checks only a CUDA machine can make, in one go (about 6 minutes on one H100/H200):
#   1. the `gpu` test suite (NCCL world of one, bf16 parity + train step, packed rows vs padded, engine on cuda, CLI
#      train + resume, CUDA IPC tensor payloads, LoRA; TE FP8 where transformer_engine imports),
#   2. benchmarks/policy_step.py: Megatron fwd+bwd MFU for a ~0.5B Llama shape in bf16 at 16 x 1024 tokens (the GPU
#      experiments' trainer.token_budget) as the trainer builds it (model.compile=auto on CUDA: the layers' element-
#      wise ops eager, the LM head's log-prob kernels compiled), all eager and all compiled beside it (the roofline
#      is the best torch.mm rate of the step's GEMM shapes on this GPU, measured in the same run), then ragged
#      rows padded against packed (flash attention's varlen kernel: trainer.pack_rows=auto on CUDA),
#   3. benchmarks/rollout_engine.py: the embedded engine's decode tokens/s against transformers.generate on a
#      SmolLM2-135M-shaped model (random weights: the speed does not depend on them), 16 prompts x 4 samples,
#      against the decode roofline (matmul rate, bandwidth) measured in the same run.
# Logs go to $OUT (default ./gpu_checks_out). Usage: bash scripts/gpu_checks.sh
# On a machine without internet whose Python has torch but not mcore-rl's other imports: bash scripts/gpu_bundle.sh
# here first and copy .gpu/ along; this script then puts .gpu/site on the path and .gpu/cache as the model cache.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ -d .gpu/site ]]; then
  export PYTHONPATH="$PWD/.gpu/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" MCORE_RL_CACHE="${MCORE_RL_CACHE:-$PWD/.gpu/cache}"
fi
OUT=${OUT:-gpu_checks_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONWARNINGS=ignore
PY=${PYTHON:-python3}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__, \
torch.cuda.get_device_name(0))"
} 2>&1 | tee "$OUT/machine.txt"

# the suite's tests are separate CUDA processes, so they share the GPU in parallel (SUITE_WORKERS=1: one by one)
XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n ${SUITE_WORKERS:-4} --dist load")
timeout "${SUITE_TIMEOUT:-300}" $PY -m pytest -q -m gpu -rA $XDIST tests/gpu tests/rollout/test_tensor_payload.py 2>&1 \
  | tee "$OUT/gpu_suite.log"

# shorter: POLICY_FLAGS="--dtypes bf16 --heads chunked" ENGINE_FLAGS="--dtypes bfloat16 --workloads fixed"
timeout "${BENCH_TIMEOUT:-170}" $PY benchmarks/policy_step.py --model llama-0.5b --batch 16 --seq 1024 --iters 5 \
  --no-hf ${POLICY_FLAGS:---dtypes bf16,bf16-eager,bf16-compiled --heads chunked} 2>&1 | tee "$OUT/policy_step.log"
# ragged rows (RL-like lengths) padded vs packed through flash varlen attention (trainer.pack_rows=auto on CUDA)
timeout "${PACK_TIMEOUT:-120}" $PY benchmarks/policy_step.py --model llama-0.5b --batch 16 --seq 1024 --iters 5 \
  --no-hf --dtypes bf16 --heads chunked,packed --ragged 2>&1 | tee "$OUT/policy_step_packed.log"

# a SmolLM2-135M-shaped random model with the SmolLM2 tokenizer (taken from the tiny model's folder)
ENGINE_DIR=$($PY - <<'EOF'
import tempfile
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from omegaconf import OmegaConf
from mcore_rl.models.source import tiny_model_dir

tiny = tiny_model_dir(OmegaConf.to_container(OmegaConf.load("hydra_conf/model/tiny.yaml").tiny))
tok = AutoTokenizer.from_pretrained(tiny)
cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, vocab_size=len(tok), tie_word_embeddings=True,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
out = tempfile.mkdtemp(prefix="smollm2_shape_")
LlamaForCausalLM(cfg).save_pretrained(out)
tok.save_pretrained(out)
print(out)
EOF
)
timeout "${ENGINE_TIMEOUT:-150}" $PY benchmarks/rollout_engine.py --model-path "$ENGINE_DIR" --device cuda \
  --prompts 16 --n 4 --new-tokens 128 --repeats 2 ${ENGINE_FLAGS:---dtypes bfloat16,float32 --workloads fixed,eos} 2>&1 \
  | tee "$OUT/rollout_engine.log"
