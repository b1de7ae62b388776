#!/usr/bin/env bash
# The vLLM backend's scaling benchmark and the native engine vs vLLM on one workload.
#
#   1. vLLM replicas scaling (python -m coordinator.bench.scaling --backend vllm): the elastic
#      scale (pre-initialised standby engines, weights from the HMM) against cold-restarting vLLM
#      on the same machine, DP1 -> DP2 -> DP1: scale latency, downtime, peak memory;
#   2. throughput (python -m coordinator.bench.throughput): the same closed-loop load (CONCURRENCY
#      clients streaming back to back), model and dps with --backend native and --backend vllm:
#      output tokens/s, TTFT and TPOT at dp 1 and dp 2;
#   3. one JSON summary (python -m coordinator.bench.backend_compare) to stdout and $OUT.
#
# Everything runs from .venv-vllm (made by `make venv-vllm`): both backends on the same torch.
#   scripts/bench_vllm_backend.sh                      # tiny model (head_dim 32), float32
#   MODEL=models/small-qwen3-moe DTYPE=bfloat16 scripts/bench_vllm_backend.sh
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-models/tiny-vllm-qwen3-moe}
DTYPE=${DTYPE:-float32}
OUT=${OUT:-bench-out/vllm-backend}
RPS=${RPS:-4}                # the scaling events' load
CONCURRENCY=${CONCURRENCY:-32}  # the throughput runs' clients
TOKENS=${TOKENS:-32}
PY=.venv-vllm/bin/python

log() { echo "[bench_vllm_backend] $*" >&2; }

[ -x "$PY" ] || make venv-vllm >&2
if [ ! -f "$MODEL/config.json" ]; then
  preset=small; case "$MODEL" in *tiny-vllm*) preset=tiny-vllm;; esac
  .venv-vllm/bin/elasticmoe make-model --arch qwen3_moe --preset "$preset" --seed 0 --out "$MODEL" >&2
fi
mkdir -p "$OUT"
common=(--model "$MODEL" --dtype "$DTYPE" --prompt-len "$TOKENS" --max-tokens "$TOKENS" --warmup-s 8 --window-s 5
        --during-s 5 --json)

log "1/3 vLLM: elastic vs cold restart, 1-2-1"
"$PY" -m coordinator.bench.scaling "${common[@]}" --backend vllm --strategy elastic,cold_restart \
  --transitions 1-2,2-1 --rps "$RPS" --out "$OUT/scaling-vllm.json" > /dev/null 2> "$OUT/scaling-vllm.log"
for backend in native vllm; do
  log "2/3 throughput, $backend, dp 1 and 2, $CONCURRENCY clients"
  "$PY" -m coordinator.bench.throughput --backend "$backend" --model "$MODEL" --dtype "$DTYPE" --dps 1,2 \
    --concurrency "$CONCURRENCY" --prompt-len "$TOKENS" --max-tokens "$TOKENS" \
    --out "$OUT/throughput-$backend.json" > /dev/null 2> "$OUT/throughput-$backend.log"
done
log "3/3 summary"
"$PY" -m coordinator.bench.backend_compare --scaling "$OUT/scaling-vllm.json" \
  --throughput native="$OUT/throughput-native.json" vllm="$OUT/throughput-vllm.json" | tee "$OUT/summary.json"
