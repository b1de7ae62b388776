#!/usr/bin/env bash
# Serving over HTTP: the same closed-loop request stream (CONCURRENCY streaming clients, PROMPT_LEN
# random token ids in, MAX_TOKENS greedy tokens out) against, in turn,
#   single   `elasticmoe serve --single` (one engine in one process),
#   elastic  the elastic server at dp 1 (`elasticmoe serve --devices 2 --dp 1`: Ray Serve ingress and
#            coordinator, HMM device memory, one rank; measured once its standby instances are booted),
#   vllm     vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server` from VLLM_PY),
# on the same checkpoint, dtype and limits (64 seqs, 2048-token step budget, max model len 256,
# KV_CACHE_GB of KV each, prefix caching off), each measured by `python -m coordinator.bench.serving`:
# output tok/s, TTFT and TPOT p50/p99. One server runs at a time and is stopped before the next
# starts; REPEATS rounds of that, the table giving each server's medians. Results (a JSON and a log
# per server and round, the table) land in $OUT; the table is printed last.
#
# Threads: our engines get NUM_THREADS (default: the cores; the elastic rank's own default is 1),
# vLLM's engine VLLM_OMP_NUM_THREADS (default 1). vLLM's OpenAI server always runs its engine core
# in a second process (VLLM_ENABLE_V1_MULTIPROCESSING=0 does not apply to it, unlike the offline
# LLM of scripts/vllm_bench.py); the API server streaming to 64 clients takes a core, and an engine
# with 2 OpenMP threads then waits at every barrier (measured here, medians of 3 rounds: 235 output
# tok/s at 2 threads, 932 at 1). A server NAME:N in SERVERS runs with N threads instead and is
# labelled NAME-tN.
#
#   scripts/bench_serving.sh
#   DURATION_S=30 DTYPE=float32 VLLM_PY=/path/to/.venv-vllm/bin/python scripts/bench_serving.sh
#   SERVERS="single elastic elastic:1" scripts/bench_serving.sh      # a subset, and a variant
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-models/small-qwen3-moe}
OUT=${OUT:-bench-out/serving}
DTYPE=${DTYPE:-bfloat16}
SERVERS=${SERVERS:-"single elastic vllm vllm:2"}
REPEATS=${REPEATS:-1}  # rounds over SERVERS; the table reports each label's medians
CONCURRENCY=${CONCURRENCY:-64}
PROMPT_LEN=${PROMPT_LEN:-128}
MAX_TOKENS=${MAX_TOKENS:-64}
WARMUP_S=${WARMUP_S:-15}
DURATION_S=${DURATION_S:-60}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-64}
MAX_NUM_BATCHED_TOKENS=${MAX_NUM_BATCHED_TOKENS:-2048}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-256}
KV_CACHE_GB=${KV_CACHE_GB:-1}     # far more than 64 x 192 tokens need, for every server
NUM_THREADS=${NUM_THREADS:-$(nproc)}  # the engine's threads in each server (the elastic rank's default is 1)
VLLM_OMP_NUM_THREADS=${VLLM_OMP_NUM_THREADS:-1}  # vLLM's engine core (its OMP_NUM_THREADS), see above
PORT=${PORT:-8765}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-900}
VLLM_PY=${VLLM_PY:-.venv-vllm/bin/python}
PY=.venv/bin/python
NAME=$(basename "$MODEL")
URL="http://127.0.0.1:$PORT"

log() { echo "[bench_serving $(date +%H:%M:%S)] $*" >&2; }

server_pid=""
stop_server() {  # SIGTERM the server we started (it shuts down what it started), then SIGKILL
  [ -n "$server_pid" ] || return 0  # whatever of its process group (setsid below) is left
  if kill -0 "$server_pid" 2>/dev/null; then
    log "stopping pid $server_pid"
    kill -TERM "$server_pid" 2>/dev/null || true
    for _ in $(seq 1 120); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.5; done
  fi
  kill -KILL -- "-$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
  server_pid=""
}
trap stop_server EXIT
trap 'stop_server; exit 130' INT
trap 'stop_server; exit 143' TERM

wait_ready() {  # $1: label; until GET /ready answers 200, the server exits, or the timeout
  local deadline=$((SECONDS + READY_TIMEOUT_S))
  until curl -sf -o /dev/null "$URL/ready"; do
    if ! kill -0 "$server_pid" 2>/dev/null; then log "$1 exited before it was ready; see $OUT/$1.log"; return 1; fi
    if [ "$SECONDS" -ge "$deadline" ]; then log "$1 not ready after ${READY_TIMEOUT_S}s"; return 1; fi
    sleep 1
  done
}

wait_health() {  # vLLM has no /ready: /health and /v1/models answer once its engine is up
  local deadline=$((SECONDS + READY_TIMEOUT_S))
  until curl -sf -o /dev/null "$URL/health" && curl -sf -o /dev/null "$URL/v1/models"; do
    if ! kill -0 "$server_pid" 2>/dev/null; then log "$1 exited before it was ready; see $OUT/$1.log"; return 1; fi
    if [ "$SECONDS" -ge "$deadline" ]; then log "$1 not ready after ${READY_TIMEOUT_S}s"; return 1; fi
    sleep 1
  done
}

# ---- venvs and model ------------------------------------------------------------------------------
[ -x .venv/bin/elasticmoe ] || make venv >&2
if [ ! -f "$MODEL/config.json" ]; then
  log "building $MODEL"
  .venv/bin/elasticmoe make-model --arch qwen3_moe --preset small --seed 0 --out "$MODEL" >&2
fi
mkdir -p "$OUT"
if curl -s -o /dev/null "$URL/"; then log "port $PORT is taken; set PORT"; exit 1; fi

limits=(--dtype "$DTYPE" --served-model-name "$NAME" --max-model-len "$MAX_MODEL_LEN"
        --max-num-seqs "$MAX_NUM_SEQS" --max-num-batched-tokens "$MAX_NUM_BATCHED_TOKENS")

start_server() {  # $1: server, $2: threads, $3: label; in its own process group (setsid), so that
  local server=$1 threads=$2 label=$3  # stop_server reaches whatever it leaves behind
  local ours=(--model "$MODEL" "${limits[@]}" --kv-cache-gb "$KV_CACHE_GB" --num-threads "$threads"
              --host 127.0.0.1 --port "$PORT")
  case "$server" in
    single)
      setsid .venv/bin/elasticmoe serve --single "${ours[@]}" > "$OUT/$label.log" 2>&1 &
      ;;
    elastic)
      setsid .venv/bin/elasticmoe serve --devices 2 --dp 1 "${ours[@]}" --max-queued 256 \
        --shm-prefix "emoeserving$$" > "$OUT/$label.log" 2>&1 &
      ;;
    vllm)
      if ! "$VLLM_PY" -c "import vllm" 2>/dev/null; then log "no vLLM at $VLLM_PY (set VLLM_PY)"; return 1; fi
      # KV space in GiB, prefix caching off, as scripts/vllm_bench.py runs it offline.
      VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE="$KV_CACHE_GB" OMP_NUM_THREADS="$threads" \
        setsid "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" "${limits[@]}" \
        --no-enable-prefix-caching --seed 0 --host 127.0.0.1 --port "$PORT" --disable-uvicorn-access-log \
        > "$OUT/$label.log" 2>&1 &
      ;;
    *) log "unknown server $server (single, elastic, vllm)"; return 1;;
  esac
  server_pid=$!
  log "$label: started pid $server_pid ($threads threads), waiting until ready"
  if [ "$server" = vllm ]; then wait_health "$label"; else wait_ready "$label"; fi
}

results=()
ratios="elastic/single,elastic/vllm"
for entry in $SERVERS; do
  [ "$entry" = "${entry%%:*}" ] || ratios+=",elastic/${entry%%:*}-t${entry#*:}"
done
for round in $(seq 1 "$REPEATS"); do
for entry in $SERVERS; do
  server=${entry%%:*}
  if [ "$entry" != "$server" ]; then
    threads=${entry#*:}; label="$server-t$threads"
  else
    threads=$NUM_THREADS; [ "$server" = vllm ] && threads=$VLLM_OMP_NUM_THREADS; label=$server
  fi
  if start_server "$server" "$threads" "$label"; then
    log "$label: measuring (round $round of $REPEATS)"
    if "$PY" -m coordinator.bench.serving --url "$URL" --served-model "$NAME" --model "$MODEL" \
        --concurrency "$CONCURRENCY" --prompt-len "$PROMPT_LEN" --max-tokens "$MAX_TOKENS" \
        --warmup-s "$WARMUP_S" --duration-s "$DURATION_S" --label "$label" --out "$OUT/$label-$round.json" \
        2> "$OUT/$label-$round-bench.log"; then
      results+=("$OUT/$label-$round.json")
    else
      log "$label: benchmark failed; see $OUT/$label-$round-bench.log"
    fi
  fi
  stop_server
done
done

[ "${#results[@]}" -gt 0 ] || { log "nothing measured"; exit 1; }
"$PY" -m coordinator.bench.serving --compare "${results[@]}" --ratios "$ratios" --out "$OUT/summary.json" \
  | tee "$OUT/table.md"
