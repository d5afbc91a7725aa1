#!/usr/bin/env bash
# The first burst after start, then the same burst a minute later, against a freshly
# started server (default preset) once its warm-up is done: 64 polite streams at once, one
# new ~2,000-token system prompt, 128-token answers (benchmarks/polite_load.py). SRC:
# another checkout to run the server from (an A/B against older code); the load generator
# is always this one's. JSON lines in OUT/. SERVE_ARGS: more `sluice serve` flags (e.g.
# SERVE_ARGS="--ttft-slack 1").
#   benchmarks/burst_polite.sh OUT_DIR [PORT] [SRC]
set -eu
cd "$(dirname "$0")/.."
. benchmarks/serve_ready.sh
serve_args 18970 "$@"
BURST="--concurrency 64 --requests 64 --warmup-requests 0 --max-tokens 128"
.venv/bin/python benchmarks/polite_load.py "http://127.0.0.1:$PORT" $BURST | tee "$OUT/first.json"
sleep 60
.venv/bin/python benchmarks/polite_load.py "http://127.0.0.1:$PORT" $BURST | tee "$OUT/second.json"
