#!/usr/bin/env bash
# Interactive traffic alone and beside a batch backlog, one server (default preset, batch
# store under OUT_DIR/store), once every step shape is compiled. JSON on the last line;
# the plot and both runs' files under OUT_DIR.
#   benchmarks/batch_interference.sh OUT_DIR [PORT] [BATCH_REQUESTS] [CONCURRENCY]
set -eu
cd "$(dirname "$0")/.."
OUT=${1:?OUT_DIR}; PORT=${2:-18950}; N=${3:-500}; C=${4:-8}
mkdir -p "$OUT"
SLUICE_DATA_DIR="$OUT/store" .venv/bin/sluice serve --port "$PORT" > "$OUT/serve.log" 2>&1 &
PID=$!
trap 'kill -INT $PID 2>/dev/null; wait $PID 2>/dev/null' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" | grep -q '"warmup_remaining_shapes":0'; do
  sleep 2
done
.venv/bin/python benchmarks/batch_interference.py "http://127.0.0.1:$PORT" "$OUT" --batch "$N" \
  --concurrency "$C"
