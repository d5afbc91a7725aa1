#!/usr/bin/env bash
# The serving benchmarks of docs/benchmarks.md, on this machine's CPU with the embedded
# model (f32). Spawns the servers itself; everything stays on 127.0.0.1. ~50 min on 2 cores.
#   benchmarks/cpu_suite.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-out/cpu-$(date +%Y%m%d-%H%M)}
S=.venv/bin/sluice
mkdir -p "$OUT"

# 1. Continuous vs static vs no prefix cache on shared-prefix, over concurrency, and
# continuous batching with static's 8 slots (same batch size, the policy alone). Admission
# by predicted TTFT is off in all four (--ttft-target 0): this compares how they batch,
# and each level starts its streams at once, a burst that admission would refuse. Two
# warm-up requests first (not counted) put the system prompt in the cache, as in service.
$S bench-sweep --spawn "continuous:--ttft-target 0" \
  --spawn "continuous-8:--max-running 8 --ttft-target 0" \
  --spawn "static:--scheduling static --ttft-target 0" \
  --spawn "no-prefix-cache:--no-prefix-cache --ttft-target 0" --workload shared-prefix \
  --concurrencies "${CONCURRENCIES:-1,4,16}" --requests-per-stream 2 --warmup-requests 2 \
  --no-progress \
  --out "$OUT/sweep" | tail -1 > "$OUT/sweep.json"

# 2. Long-interference and overload against one continuous server.
PORT=18777
$S serve --port $PORT > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null || true' EXIT
until curl -sf http://127.0.0.1:$PORT/health > /dev/null; do sleep 2; done
$S bench --url http://127.0.0.1:$PORT --workload shared-prefix --concurrency 16 \
  --ramp-up 20 --requests 48 --warmup-requests 2 --no-progress --out "$OUT/shared-prefix-c16" \
  | tail -1 > "$OUT/shared-prefix-c16.json"
$S bench --url http://127.0.0.1:$PORT --workload long-interference --no-progress \
  --out "$OUT/long-interference" | tail -1 > "$OUT/long-interference.json"
# Capacity is probed first (closed loop at 16): with the system prompt cached and the
# streams ramped, as in the steady state, so that the probe measures capacity rather than
# admission refusing a cold burst.
$S bench --url http://127.0.0.1:$PORT --workload overload --overload-factor 5 --duration 40 \
  --warmup-requests 2 --ramp-up 20 --no-progress --out "$OUT/overload" \
  | tail -1 > "$OUT/overload.json"
echo "results in $OUT"
