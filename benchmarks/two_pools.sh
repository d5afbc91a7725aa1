#!/usr/bin/env bash
# Two models on one machine (config/two-models.toml: SmolLM2-135M-Instruct and Gemma 3
# 270M, each its own pool, runners and scheduler): each pool under load alone, then both
# at once, from the same polite clients (benchmarks/polite_load.py: C streams of the
# shared-prefix workload each, a 2,000-token system prompt, 128-token answers). On one
# CPU the pools' steps share its cores: "together" beside "alone" is what sharing costs.
# Prints one JSON line per run ({"run": "<model>-alone|together", "result": {...}}).
#   benchmarks/two_pools.sh OUT_DIR [PORT] [C]
set -eu
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:?OUT_DIR}"); PORT=${2:-18986}; C=${3:-4}
mkdir -p "$OUT"
. benchmarks/serve_ready.sh
serve_ready "$OUT" "$PORT" --config config/two-models.toml
URL="http://127.0.0.1:$PORT"
load() {  # model, output file
  .venv/bin/python benchmarks/polite_load.py "$URL" --model "$1" --concurrency "$C" \
    --requests $((4 * C)) --warmup-requests "$C" --max-tokens 128 > "$2"
}
for m in smollm2-135m-instruct gemma-3-270m; do load "$m" "$OUT/$m-alone.json"; done
load smollm2-135m-instruct "$OUT/smollm2-135m-instruct-together.json" &
OTHER=$!
load gemma-3-270m "$OUT/gemma-3-270m-together.json"
wait "$OTHER"  # (a bare `wait` would wait for the server too)
ps -o rss= -p "$PID" | awk '{print $1 * 1024}' > "$OUT/rss-bytes"
for f in "$OUT"/*-alone.json "$OUT"/*-together.json; do
  printf '{"run": "%s", "result": %s}\n' "$(basename "$f" .json)" "$(cat "$f")"
done
