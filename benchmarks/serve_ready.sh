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
