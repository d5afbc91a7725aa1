#!/usr/bin/env bash
# The console under `sluice bench` load, one server (default preset), once every step shape
# is compiled: tok/s unwatched / polled like the dashboard / with the dashboard open in
# headless Chromium, the dashboard's TTFT/ITL against the bench's and /metrics', and the
# two screenshots. JSON on the last line; screenshots and runs under OUT_DIR.
#   benchmarks/experiments/console_under_load.sh OUT_DIR [PORT] [ORDER]
set -eu
cd "$(dirname "$0")/../.."
OUT=${1:?OUT_DIR}; PORT=${2:-18960}; ORDER=${3:-none,poll,browser,none,poll}
mkdir -p "$OUT"
. benchmarks/serve_ready.sh
serve_ready "$OUT" "$PORT"
.venv/bin/python benchmarks/experiments/console_under_load.py "http://127.0.0.1:$PORT" "$OUT" --order "$ORDER"
