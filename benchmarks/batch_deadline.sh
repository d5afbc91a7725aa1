#!/usr/bin/env bash
# A batch whose window is too short for background-only progress, beside interactive
# load at concurrency 8, on one server (default preset, store under OUT_DIR/store).
#   benchmarks/batch_deadline.sh OUT_DIR [PORT] [BATCH_REQUESTS] [WINDOW]
set -eu
cd "$(dirname "$0")/.."
OUT=${1:?OUT_DIR}; PORT=${2:-18960}; N=${3:-120}; WINDOW=${4:-4m}
mkdir -p "$OUT"
SLUICE_DATA_DIR="$OUT/store" .venv/bin/sluice serve --port "$PORT" > "$OUT/serve.log" 2>&1 &
PID=$!
trap 'kill -INT $PID 2>/dev/null; wait $PID 2>/dev/null' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" | grep -q '"warmup_remaining_shapes":0'; do
  sleep 2
done
.venv/bin/python benchmarks/batch_deadline.py "http://127.0.0.1:$PORT" "$OUT" --batch "$N" \
  --window "$WINDOW"
