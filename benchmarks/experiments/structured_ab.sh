#!/usr/bin/env bash
# Structured output's cost in service: one default server, once every shape is compiled,
# shared-prefix at concurrency 16 alternating free answers and answers constrained by a
# small JSON schema (every request), twice each (this machine's speed drifts over
# minutes). Then the grammar compile time of new schemas, from the server's log-free
# side: a request with a fresh schema against one with a cached one.
#   benchmarks/experiments/structured_ab.sh OUT_DIR [PORT]
set -eu
cd "$(dirname "$0")/../.."
OUT=${1:?OUT_DIR}; PORT=${2:-18960}
mkdir -p "$OUT"
. benchmarks/serve_ready.sh
serve_ready "$OUT" "$PORT"
SCHEMA='{"response_format": {"type": "json_schema", "json_schema": {"name": "answer",
  "schema": {"type": "object", "properties": {"answer": {"type": "string"},
  "confidence": {"type": "integer", "minimum": 0, "maximum": 10}},
  "required": ["answer", "confidence"], "additionalProperties": false}}}}'
BENCH=".venv/bin/sluice bench --url http://127.0.0.1:$PORT --workload shared-prefix \
  --concurrency 16 --ramp-up 20 --warmup-requests 2 --requests 48 --no-progress"
for round in $(seq "${ROUNDS:-2}"); do
  $BENCH --label "free-$round" --out "$OUT/free-$round" | tail -1 > "$OUT/free-$round.json"
  $BENCH --label "schema-$round" --extra-body "$SCHEMA" --out "$OUT/schema-$round" \
    | tail -1 > "$OUT/schema-$round.json"
done
.venv/bin/python benchmarks/experiments/grammar_compile.py --url "http://127.0.0.1:$PORT" \
  > "$OUT/compile.json"
cat "$OUT/compile.json"
