#!/usr/bin/env bash
# The shared-prefix closed loop at concurrency 16 against a freshly started default server
# run from SRC (another checkout: an A/B against older code; default this one), once every
# shape is compiled. The load generator is always this checkout's. Output in OUT/.
# BENCH_ARGS: more `sluice bench` flags (e.g. "--temperature 1": sampled answers).
#   benchmarks/experiments/ab_serve_c16.sh OUT [PORT] [SRC] [-- extra `sluice serve` flags]
set -eu
cd "$(dirname "$0")/../.."
HERE=$PWD
OUT=$(realpath -m "${1:?OUT}"); PORT=${2:-18975}; SRC=${3:-$PWD}
shift $(( $# < 3 ? $# : 3 )); [ "${1:-}" = "--" ] && shift
mkdir -p "$OUT"
(cd "$SRC" && SLUICE_DATA_DIR="$OUT/store" PYTHONPATH="$SRC" "$HERE/.venv/bin/python" -m app.cli \
  serve --port "$PORT" "$@" > "$OUT/serve.log" 2>&1) &
trap 'pkill -INT -f "app.cli serve --port $PORT"; wait' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" | grep -q '"warmup_remaining_shapes":0'; do
  sleep 1
done
.venv/bin/sluice bench --url "http://127.0.0.1:$PORT" --workload shared-prefix --concurrency 16 \
  --ramp-up 20 --warmup-requests 2 --requests 48 ${BENCH_ARGS:-} --out "$OUT" \
  > "$OUT/bench.txt" 2>&1
tail -n 1 "$OUT/bench.txt"
