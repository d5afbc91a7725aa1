# Sourced by the benchmark scripts: `serve_ready OUT PORT [serve flags...]` starts
# `sluice serve` (batch store under OUT/store, log OUT/serve.log), stops it when the
# script exits, and returns once every step shape is compiled. Sets PID.
serve_ready() {
  local out=$1 port=$2
  shift 2
  if curl -s -o /dev/null "http://127.0.0.1:$port/health"; then
    echo "port $port is taken (a server still draining?)" >&2
    exit 1
  fi
  SLUICE_DATA_DIR="$out/store" .venv/bin/sluice serve --port "$port" "$@" \
    > "$out/serve.log" 2>&1 &
  PID=$!
  trap 'kill -INT $PID 2>/dev/null; wait $PID 2>/dev/null' EXIT
  until curl -sf "http://127.0.0.1:$port/health" | grep -q '"warmup_remaining_shapes":0'; do
    sleep 2
  done
}

# `serve_from SRC OUT PORT [serve flags...]`: the same from another checkout SRC (an A/B
# against older code: its code, this checkout's venv), stopped when the script exits.
serve_from() {
  local src=$1 out=$2 port=$3 here=$PWD
  shift 3
  (cd "$src" && SLUICE_DATA_DIR="$out/store" PYTHONPATH="$src" "$here/.venv/bin/python" \
    -m app.cli serve --port "$port" "$@" > "$out/serve.log" 2>&1) &
  trap "pkill -INT -f 'app.cli serve --port $port'; wait" EXIT
  until curl -sf "http://127.0.0.1:$port/health" | grep -q '"warmup_remaining_shapes":0'; do
    sleep 1
  done
}

# `serve_args DEFAULT_PORT OUT_DIR [PORT] [SRC]`: a script's own arguments: sets OUT
# (absolute, created), PORT (default DEFAULT_PORT) and SRC (default this checkout), then
# serve_from SRC OUT PORT with SERVE_ARGS' flags.
serve_args() {
  local default_port=$1
  shift
  OUT=$(realpath -m "${1:?OUT_DIR}"); PORT=${2:-$default_port}; SRC=${3:-$PWD}
  mkdir -p "$OUT"
  serve_from "$SRC" "$OUT" "$PORT" ${SERVE_ARGS:-}
}
