#!/usr/bin/env bash
# The 8B decode step's layer loop on an H200, three ways, each in its own process
# (benchmarks/h200_attention.py's engine_8b: batch 32, 1k context, random Llama-3-8B bf16):
#   unrolled  the loop unrolled over per-layer weights (ModelRunner(unrolled_layers=True)),
#             then serving through the engine the same way, and a profile of 3 steps;
#   scan      the layer scan over stacked weights (the default before);
#   scan+dsf  the scan with XLA's dynamic-slice fusion flag.
# A profile of the scan showed each layer's weight slices copied before their matmuls
# (docs/benchmarks.md, "Accelerator (H200)").
#   run(command="bash benchmarks/experiments/h200_layer_loop_ab.sh", carry=[".whl"], timeout_s=380)
set -u
OUT=${OUT:-/tmp/h200-layer-loop}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
B="python3 benchmarks/h200_attention.py --serving-seconds 30"
variant() {  # name seconds args...
  local name=$1 secs=$2; shift 2
  local t0=$(date +%s)
  timeout "$secs" "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? in $(( $(date +%s) - t0 )) s"
  python3 - "$OUT/$name.json" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"no result: {e}")
for k in ("engine_8b", "serving_8b"):
    if k in r:
        print(k, json.dumps({a: b for a, b in r[k].items() if a not in ("runner", "traceback")}))
EOF
}
variant unrolled 200 $B --skip copy decode mixed --profile-dir /tmp/h200-profile \
  --runner-opts '{"unrolled_layers": true}'
trace=$(find /tmp/h200-profile -name '*.trace.json.gz' 2>/dev/null | head -1)
[ -n "$trace" ] && cp "$trace" "$OUT/unrolled_trace.json.gz"
variant scan 70 $B --skip copy decode mixed serving_8b
XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true \
  variant scan_dsf 70 $B --skip copy decode mixed serving_8b
