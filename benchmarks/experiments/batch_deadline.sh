#!/usr/bin/env bash
# A batch whose window is too short for background-only progress, beside interactive
# load at concurrency 8, on one server (default preset, store under OUT_DIR/store).
#   benchmarks/experiments/batch_deadline.sh OUT_DIR [PORT] [BATCH_REQUESTS] [WINDOW]
set -eu
cd "$(dirname "$0")/../.."
OUT=${1:?OUT_DIR}; PORT=${2:-18960}; N=${3:-120}; WINDOW=${4:-4m}
mkdir -p "$OUT"
. benchmarks/serve_ready.sh
serve_ready "$OUT" "$PORT"
.venv/bin/python benchmarks/experiments/batch_deadline.py "http://127.0.0.1:$PORT" "$OUT" --batch "$N" \
  --window "$WINDOW"
