#!/usr/bin/env bash
# The ITL target's trade-off (issue 16): one server per target, the same closed-loop
# shared-prefix load at concurrency 16 against each, for a fixed time.
#   benchmarks/experiments/itl_sweep.sh OUT [TARGETS]    e.g. bench-out/issue16/sweep 0,0.1,0.15,0.2,0.3
set -euo pipefail
out=${1:?usage: itl_sweep.sh OUT [TARGETS]}
targets=${2:-0,0.1,0.15,0.2,0.3}
cd "$(dirname "$0")/../.."
exec .venv/bin/sluice bench-sweep --itl-targets "$targets" --concurrencies 16 \
    --workload shared-prefix --ramp-up 20 --warmup-requests 2 --duration 90 \
    --out "$out"
