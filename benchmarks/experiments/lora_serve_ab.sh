#!/usr/bin/env bash
# Serving with LoRA adapters beside serving the base model, one server, side by side:
# 4 random adapters of rank 16 on all seven projections (benchmarks/experiments/make_adapters.py),
# declared in a pool with max_loras = 4 and a 1 GiB KV pool (otherwise the default
# preset: each adapter keeps its own copy of the shared system prompt); once every shape
# is compiled, shared-prefix at concurrency 16 alternates: base, --adapters 4, base,
# --adapters 4 (alternating because this machine's speed drifts over minutes).
# POOL_EXTRA adds lines to the pool's config (e.g. 'kv_cache_dtype = "bfloat16"').
#   benchmarks/experiments/lora_serve_ab.sh OUT_DIR [PORT]
set -eu
cd "$(dirname "$0")/../.."
OUT=${1:?OUT_DIR}; PORT=${2:-18900}
mkdir -p "$OUT"
{ printf '[[pools]]\nkv_cache_bytes = 1073741824\n%s\n' "${POOL_EXTRA:-}"
  .venv/bin/python benchmarks/experiments/make_adapters.py --n 4 --rank 16 --out "$OUT/adapters"; } \
  > "$OUT/lora.toml"
. benchmarks/serve_ready.sh
serve_ready "$OUT" "$PORT" --config "$OUT/lora.toml"
BENCH=".venv/bin/sluice bench --url http://127.0.0.1:$PORT --workload shared-prefix \
  --concurrency 16 --ramp-up 20 --warmup-requests 4 --requests 48 --no-progress"
for round in 1 2; do
  $BENCH --label "base-$round" --out "$OUT/base-$round" | tail -1 > "$OUT/base-$round.json"
  $BENCH --label "adapters-$round" --adapters 4 --out "$OUT/adapters-$round" \
    | tail -1 > "$OUT/adapters-$round.json"
done
grep VmHWM /proc/$PID/status > "$OUT/rss.txt"; grep VmRSS /proc/$PID/status >> "$OUT/rss.txt"
curl -s "http://127.0.0.1:$PORT/metrics" | grep '^sluice:lora' > "$OUT/lora_metrics.txt"
