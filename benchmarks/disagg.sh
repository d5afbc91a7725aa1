#!/usr/bin/env bash
# Prefill and decode apart against both on each replica, on the same two cores: the
# long-interference workload (`sluice bench --workload long-interference`: 4 short streams
# in a closed loop for WARMUP seconds (30: the "before" ITL over ~3,000 gaps), then a
# 6,000-token prompt answered with 256 tokens) against
#   both:  one server, the default preset with two replicas, one per CPU device
#          (XLA's host platform split in two; the router spreads requests over them);
#   apart: a prefill server on core 0 (`--role prefill`) and a decode server on core 1
#          (`--role decode --prefill-url ...`), each the default preset, one process
#          each (taskset), the clients on the decode server (the client process itself
#          runs on core 0 in every layout, so it never takes the decode core's time);
#   apart1p: both in one server, a prefill pool on CPU device 0 and a decode pool on
#          device 1 (`prefill_urls = ["pool:prefill"]`; their steps share XLA's threads).
# Prints one JSON line per layout: the short streams' ITL p95 before, during the long
# prompt's prefill and while it decodes, their ratios, the long request's TTFT, output
# tok/s, and (apart) the transfer's bytes and seconds. Logs and raw results under OUT.
#   benchmarks/disagg.sh OUT_DIR [PORT]
set -eu
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:?OUT_DIR}"); PORT=${2:-18990}
mkdir -p "$OUT"
URL="http://127.0.0.1:$PORT"
PURL="http://127.0.0.1:$((PORT + 1))"
ready() {  # URL: every step shape compiled
  until curl -sf "$1/health" | grep -q '"warmup_remaining_shapes":0'; do sleep 2; done
}
PIDS=""
trap 'kill -INT $PIDS 2>/dev/null; wait 2>/dev/null' EXIT
bench() {  # layout (the client on core 0: apart, never on the decode server's core)
  taskset -c 0 .venv/bin/sluice bench --url "$URL" --workload long-interference \
    --long-max-tokens 256 --warmup "${WARMUP:-30}" > "$OUT/$1.json"
  curl -s "$URL/metrics" > "$OUT/$1-metrics.txt"
}
stop() {
  kill -INT $PIDS 2>/dev/null || true
  wait $PIDS 2>/dev/null || true
  PIDS=""
}
two_devices() {  # layout config: one server over two CPU devices, then bench it
  XLA_FLAGS="--xla_force_host_platform_device_count=2 ${XLA_FLAGS:-}" \
    SLUICE_DATA_DIR="$OUT/store-$1" .venv/bin/sluice serve --config "$2" --port "$PORT" \
    > "$OUT/$1.log" 2>&1 &
  PIDS=$!
  ready "$URL"
  bench "$1"
}

sed -e 's/^replicas = 1/replicas = 2/' -e 's/^# devices = \[0, 1\] /devices = [0, 1] /' \
  config/default.toml > "$OUT/both.toml"
two_devices both "$OUT/both.toml"
stop

SLUICE_DATA_DIR="$OUT/store-prefill" taskset -c 0 .venv/bin/sluice serve --role prefill \
  --port "$((PORT + 1))" > "$OUT/prefill.log" 2>&1 &
PIDS=$!
SLUICE_DATA_DIR="$OUT/store-decode" taskset -c 1 .venv/bin/sluice serve --role decode \
  --prefill-url "$PURL" --port "$PORT" > "$OUT/decode.log" 2>&1 &
PIDS="$PIDS $!"
ready "$PURL"
ready "$URL"
bench apart
curl -s "$PURL/metrics" > "$OUT/prefill-metrics.txt"
stop

cat > "$OUT/apart1p.toml" <<'TOML'
[[pools]]
name = "prefill"
role = "prefill"
devices = [0]
[[pools]]
name = "decode"
role = "decode"
prefill_urls = ["pool:prefill"]
devices = [1]
TOML
two_devices apart1p "$OUT/apart1p.toml"
cp "$OUT/apart1p-metrics.txt" "$OUT/apart1p-prefill-metrics.txt"
stop

.venv/bin/python - "$OUT" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])

def metric(text, name, **labels):
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total

for layout in ("both", "apart", "apart1p"):
    r = json.loads((out / f"{layout}.json").read_text())
    i = r["long_interference"]
    m = (out / f"{layout}-metrics.txt").read_text()
    row = {"layout": layout,
           "short_itl_p95_before_s": i["short_itl_before_s"]["p95"],
           "short_itl_p95_during_prefill_s": i["short_itl_during_s"]["p95"],
           "p95_during_over_before": i["p95_during_over_before"],
           "short_itl_p95_while_long_decodes_s": i["short_itl_while_long_decodes_s"]["p95"],
           "p95_while_long_decodes_over_before": i["p95_while_long_decodes_over_before"],
           "long_ttft_s": i["long"]["ttft_s"], "long_e2e_s": i["long"]["e2e_s"],
           "output_tok_s": r["throughput"]["output_tokens_per_s"],
           "ttft_p95_s": r["ttft_s"]["p95"], "itl_p95_s": r["itl_s"]["p95"]}
    if layout != "both":
        p = (out / ("prefill-metrics.txt" if layout == "apart"
                    else "apart1p-prefill-metrics.txt")).read_text()
        n = metric(m, "sluice:remote_prefill_seconds_count")
        row["remote_prefills"] = n
        row["transfer_bytes"] = metric(m, "sluice:kv_transfer_bytes_total", direction="received")
        if n:
            # ask to pages in the inbox; of it, moving the pages: copy out and encode on
            # the prefill server, then HTTP, checks and the inbox here
            row["remote_prefill_s_mean"] = metric(m, "sluice:remote_prefill_seconds_sum") / n
            row["transfer_s_mean"] = metric(m, "sluice:kv_transfer_seconds_sum",
                                            direction="received") / n
            row["copy_out_s_mean"] = metric(p, "sluice:kv_transfer_seconds_sum",
                                            direction="sent") / n
    print(json.dumps(row))
PY
