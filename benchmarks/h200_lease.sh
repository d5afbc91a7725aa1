#!/usr/bin/env bash
# Everything an H200 lease runs, in one command (the device tool's `run`, from the repo root):
#   1. the Pallas kernel suite compiled for real (tests/pallas_kernels/test_paged_attention.py,
#      the cases the CPU runs in interpret mode, plus the Triton lowering checks);
#   2. benchmarks/h200_attention.py: copy bandwidth, decode and mixed attention (Pallas vs
#      XLA), the runner end to end and serving through the engine on random Llama-3-8B
#      weights (bf16).
# Each part has its own time limit and writes under $OUT as it goes, so a part that fails or
# runs long costs only itself. Wheels for the engine's pure-Python needs the image lacks
# (trio, sniffio, outcome, msgspec) travel in .whl/ (docs/benchmarks.md, "Accelerator (H200)").
#   run(command="bash benchmarks/h200_lease.sh", carry=[".whl"], timeout_s=...)
# Env: TEST_S (120), BENCH_S (330), SERVING_S (30: the serving window), BENCH_ARGS (e.g.
# "--sweep-only --skip serving_8b --profile-dir /tmp/h200-profile").
set -u
OUT=${OUT:-/tmp/h200-lease}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
    --format=csv 2>&1
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())" 2>&1
} | tee "$OUT/env.txt"

t0=$(date +%s)
timeout "${TEST_S:-120}" python3 -m pytest -c /dev/null --rootdir . -q -p no:cacheprovider \
  -k "not interpret" tests/pallas_kernels/test_paged_attention.py --maxfail 3 --tb=short \
  --timeout 60 -rs \
  > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? in $(( $(date +%s) - t0 )) s"; tail -15 "$OUT/pytest.log"

t0=$(date +%s)
timeout "${BENCH_S:-330}" python3 benchmarks/h200_attention.py --out "$OUT/h200_attention.json" \
  --serving-seconds "${SERVING_S:-30}" ${BENCH_ARGS:-} > "$OUT/attention.log" 2>&1
echo "h200_attention rc=$? in $(( $(date +%s) - t0 )) s"
grep -v '^{' "$OUT/attention.log" | tail -40
# --profile-dir DIR in BENCH_ARGS: the perfetto trace of three 8B decode steps comes back
trace=$(find /tmp/h200-profile -name '*.trace.json.gz' 2>/dev/null | head -1)
[ -n "$trace" ] && cp "$trace" "$OUT/decode_trace.json.gz"
python3 - "$OUT/h200_attention.json" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:  # killed before the first save, or mid-write
    sys.exit(f"no result: {e}")
for k, v in r.items():
    print(k, json.dumps(v)[:600])
EOF
