#!/usr/bin/env bash
# ElasticMoE's engine vs vLLM (CPU build) on the same checkpoint, offline batch:
# 64 prompts x 128 random token ids -> 64 greedy tokens each, bfloat16 and float32.
# Prints one JSON object (ours, vLLM and ours/vLLM ratios per dtype) to stdout and
# keeps it and the per-run JSON/logs in $OUT.
#
# vLLM lives in its own venv (.venv-vllm: the project with its `vllm` extra, made by
# `make venv-vllm` on first use, reused after): it pins its own transformers/fastapi and is
# never a dependency of the two set-up commands.
#
#   scripts/bench_vs_vllm.sh                       # defaults below
#   DTYPES=bfloat16 REPEATS=5 scripts/bench_vs_vllm.sh
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-models/small-qwen3-moe}
OUT=${OUT:-bench-out/vs-vllm}
DTYPES=${DTYPES:-"bfloat16 float32"}
REPEATS=${REPEATS:-3}
NUM_PROMPTS=${NUM_PROMPTS:-64}
INPUT_LEN=${INPUT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-64}
MAX_NUM_BATCHED_TOKENS=${MAX_NUM_BATCHED_TOKENS:-2048}
KV_CACHE_GB=${KV_CACHE_GB:-4}  # far more than the workload needs (~50 MB in bf16), for both engines
SEED=${SEED:-0}
log() { echo "[bench_vs_vllm] $*" >&2; }

# ---- both venvs, by the project's own bootstrap (idempotent) -----------------------------
make venv venv-vllm >&2
VLLM_VENV=.venv-vllm

# ---- model ---------------------------------------------------------------------------
if [ ! -f "$MODEL/config.json" ]; then
  log "building $MODEL"
  .venv/bin/elasticmoe make-model --arch qwen3_moe --preset small --seed 0 --out "$MODEL" >&2
fi

# ---- runs: vLLM then ours, per dtype, so each pair sees similar machine load ----------
mkdir -p "$OUT"
common=(--model "$MODEL" --num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN"
        --max-num-batched-tokens "$MAX_NUM_BATCHED_TOKENS" --max-num-seqs "$NUM_PROMPTS"
        --kv-cache-gb "$KV_CACHE_GB" --seed "$SEED" --repeats "$REPEATS")
vllm_jsons=()
ours_jsons=()
for dtype in $DTYPES; do
  log "vLLM $dtype"
  # In-process engine core (no engine process busy-polling beside the client on 2 cores);
  # vllm_bench.py also sets VLLM_CPU_KVCACHE_SPACE and OMP_NUM_THREADS (= usable cores).
  if VLLM_ENABLE_V1_MULTIPROCESSING=0 "$VLLM_VENV/bin/python" scripts/vllm_bench.py run "${common[@]}" \
      --dtype "$dtype" > "$OUT/vllm-$dtype.json" 2> "$OUT/vllm-$dtype.log"; then
    vllm_jsons+=("$OUT/vllm-$dtype.json")
  else
    log "vLLM $dtype failed; see $OUT/vllm-$dtype.log"
  fi
  log "ours $dtype"
  if .venv/bin/python -m elasticmoe.bench.engine "${common[@]}" --dtype "$dtype" --json \
      > "$OUT/ours-$dtype.json" 2> "$OUT/ours-$dtype.log"; then
    ours_jsons+=("$OUT/ours-$dtype.json")
  else
    log "ours $dtype failed; see $OUT/ours-$dtype.log"
  fi
done

.venv/bin/python scripts/vllm_bench.py compare --model "$MODEL" \
  --vllm "${vllm_jsons[@]}" --ours "${ours_jsons[@]}" | tee "$OUT/vs_vllm.json"
