#!/usr/bin/env bash
# The door under a flood (benchmarks/flood.py): a freshly started server (default preset
# plus SERVE_ARGS) streaming to 16 polite clients, then FLOOD requests at once on new
# connections, /health probed before and during (every 10 ms). SRC: another checkout to run the server
# from (an A/B against older code); the load generator is always this one's. JSON in
# OUT/flood.json.
#   FLOOD=300 benchmarks/flood.sh OUT_DIR [PORT] [SRC]
#   FLOOD=64 SERVE_ARGS="--max-waiting 8" benchmarks/flood.sh OUT_DIR   (a small queue bound)
set -eu
cd "$(dirname "$0")/.."
. benchmarks/serve_ready.sh
serve_args 18971 "$@"
.venv/bin/python benchmarks/flood.py "http://127.0.0.1:$PORT" --flood "${FLOOD:-300}" \
  | tee "$OUT/flood.json"
