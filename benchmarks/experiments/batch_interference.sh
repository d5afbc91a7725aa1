#!/usr/bin/env bash
# Interactive traffic alone and beside a batch backlog, one server (default preset, batch
# store under OUT_DIR/store), once every step shape is compiled. JSON on the last line;
# the plot and both runs' files under OUT_DIR.
#   benchmarks/experiments/batch_interference.sh OUT_DIR [PORT] [BATCH_REQUESTS] [CONCURRENCY]
set -eu
cd "$(dirname "$0")/../.."
OUT=${1:?OUT_DIR}; PORT=${2:-18950}; N=${3:-500}; C=${4:-8}
mkdir -p "$OUT"
. benchmarks/serve_ready.sh
serve_ready "$OUT" "$PORT"
.venv/bin/python benchmarks/experiments/batch_interference.py "http://127.0.0.1:$PORT" "$OUT" --batch "$N" \
  --concurrency "$C"
