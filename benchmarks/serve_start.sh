#!/usr/bin/env bash
# Start-up of `sluice serve` (default preset) as a user sees it: seconds from the command to
# "listening" and to /health 200, the first streamed answer's TTFT, seconds until every
# step shape is compiled, and the server's resident memory (ready, idle, peak).
#   benchmarks/serve_start.sh [CACHE_DIR] [PORT]
# An empty or new CACHE_DIR measures a cold start (nothing compiled); run it twice for warm.
set -u
cd "$(dirname "$0")/.."
CACHE=${1:-$(mktemp -d)}; PORT=${2:-18800}
LOG=$(mktemp)
T0=$(date +%s.%N)
SLUICE_JAX_CACHE=$CACHE .venv/bin/sluice serve --port "$PORT" > "$LOG" 2>&1 &
PID=$!
trap 'kill -INT $PID 2>/dev/null; wait $PID 2>/dev/null' EXIT
since() { echo "$(date +%s.%N) - $T0" | bc; }
listening=""
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
  [ -z "$listening" ] && grep -q listening "$LOG" && listening=$(since)
  sleep 0.25
done
ready=$(since)
rss_ready=$(awk '/VmRSS/ {print $2}' /proc/$PID/status)
ttft=$(.venv/bin/python - "$PORT" <<'PY'
import json, sys, time, httpx
body = {"model": "smollm2-135m-instruct", "stream": True, "temperature": 0, "max_tokens": 30,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}
t, first, text = time.time(), None, ""
with httpx.stream("POST", f"http://127.0.0.1:{sys.argv[1]}/v1/chat/completions", json=body,
                  timeout=120) as r:
    for line in r.iter_lines():
        if line.startswith("data: {"):
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if delta:
                first = first or time.time() - t
                text += delta
print(json.dumps({"ttft_s": round(first, 2), "answer": text}))
PY
)
until curl -s "http://127.0.0.1:$PORT/health" | grep -q '"warmup_remaining_shapes":0'; do sleep 1; done
all_shapes=$(since)
sleep 3
read -r rss_idle peak < <(awk '/VmRSS/ {r=$2} /VmHWM/ {h=$2} END {print r, h}' /proc/$PID/status)
printf '{"listening_s": %.1f, "ready_s": %.1f, "first_answer": %s, "all_shapes_s": %.1f, "rss_gb": {"ready": %.3f, "idle": %.3f, "peak": %.3f}}\n' \
  "$listening" "$ready" "$ttft" "$all_shapes" "$(echo "$rss_ready / 1000000" | bc -l)" \
  "$(echo "$rss_idle / 1000000" | bc -l)" "$(echo "$peak / 1000000" | bc -l)"
